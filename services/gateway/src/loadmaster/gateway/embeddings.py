"""Embeddings through the dispatcher: an `EmbeddingRequest` becomes one tensor call to an
embedding model (engines/embedding.py in the model pool), batched on the worker with every
other call to that model.

The call travels the tensor path every model uses (scheduler queue, priority, deadline, cold
load, worker slot, the worker's batcher); its tensors are `text` BYTES [n] (UTF-8, "" where
the input is token ids), `token_ids` BYTES [n] (little-endian uint32, "" where it is text)
and `dimensions` INT32 [n] (0: the model's own size); the model answers `embedding` FLOAT32
[n, D] and `tokens` INT32 [n].
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from loadmaster.common.errors import InternalError
from loadmaster.common.gateway_config import LimitsSettings
from loadmaster.common.tensors import serialize_bytes
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.kserve_calls import (
    DEFAULT_PRIORITY,
    KServeInput,
    build_call,
    dispatch,
    outputs_of,
)

__all__ = ["Embedder", "EmbeddingRequest", "EmbeddingResult"]

EmbeddingInput = str | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """One validated request (frontends/openai_embeddings.py builds it from the body)."""

    model: str
    inputs: tuple[EmbeddingInput, ...]
    dimensions: int | None = None
    priority: int | None = None
    deadline_ms: float | None = None
    client_id: str | None = None
    user: str | None = None


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    vectors: np.ndarray  # float32 [n, dimensions or the model's size]
    tokens: tuple[int, ...]  # each input's token count

    @property
    def prompt_tokens(self) -> int:
        return sum(self.tokens)


def _inputs(request: EmbeddingRequest) -> list[KServeInput]:
    texts = np.array(
        [item.encode() if isinstance(item, str) else b"" for item in request.inputs], dtype=object
    )
    ids = np.array(
        [b"" if isinstance(item, str) else np.asarray(item, "<u4").tobytes() for item in request.inputs],
        dtype=object,
    )
    rows = len(request.inputs)
    dims = np.full(rows, request.dimensions or 0, dtype="<i4")
    return [
        KServeInput("text", "BYTES", (rows,), serialize_bytes(texts)),
        KServeInput("token_ids", "BYTES", (rows,), serialize_bytes(ids)),
        KServeInput("dimensions", "INT32", (rows,), dims.tobytes()),
    ]


class Embedder:
    """Runs `EmbeddingRequest`s on the model pool."""

    def __init__(
        self, dispatcher: Dispatcher, limits: LimitsSettings, *, default_timeout_ms: float = 0.0
    ) -> None:
        self._dispatcher = dispatcher
        self._limits = limits
        self._default_timeout_ms = default_timeout_ms
        self._ids = itertools.count(1)

    async def embed(self, request: EmbeddingRequest, *, request_id: str, client_id: str) -> EmbeddingResult:
        """The vectors, or a `LoadmasterError` (the engine's `invalid_argument` names the input).
        Cancelling the await cancels the call in the dispatcher."""
        call = build_call(
            _inputs(request),
            model_id=request.model,
            request_id=f"{request_id}-{next(self._ids)}",
            client_id=client_id,
            priority=DEFAULT_PRIORITY if request.priority is None else request.priority,
            timeout_ms=request.deadline_ms or self._default_timeout_ms,  # 0: the model's queue TTL
            limits=self._limits,
        )
        result = await dispatch(self._dispatcher, call)
        outputs = {out.name: out for out in outputs_of(result)}
        vectors, tokens = outputs.get("embedding"), outputs.get("tokens")
        rows = len(request.inputs)
        if (
            vectors is None
            or tokens is None
            or vectors.datatype != "FP32"
            or len(vectors.shape) != 2
            or vectors.shape[0] != rows
            or tokens.shape != (rows,)
        ):
            raise InternalError(
                f"model '{request.model}' did not answer with `embedding` FP32 [{rows}, D] and `tokens` [{rows}]"
            )
        matrix = np.frombuffer(vectors.data, dtype="<f4").reshape(rows, vectors.shape[1])
        if request.dimensions is not None:
            matrix = matrix[:, : request.dimensions]
        counts = np.frombuffer(tokens.data, dtype="<i4") if tokens.datatype == "INT32" else None
        if counts is None or counts.size != rows:
            raise InternalError(f"model '{request.model}' answered `tokens` as {tokens.datatype}, not INT32")
        return EmbeddingResult(matrix, tuple(int(count) for count in counts))
