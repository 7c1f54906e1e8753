"""Image generation through the dispatcher: an `ImageRequest` becomes one tensor call to an
image model (engines/diffusers.py in the model pool), whose `images` output is PNG files.

The call travels the tensor path every model uses (scheduler queue, priority, deadline, cold
load, worker slot); its tensors are `prompt` BYTES [1], `size` INT32 [2] (width, height),
`n` INT32 [1] and `seed` INT64 [1] (-1: the engine draws one).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from loadmaster.common.errors import InternalError
from loadmaster.common.gateway_config import LimitsSettings
from loadmaster.common.tensors import deserialize_bytes, serialize_bytes
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.kserve_calls import (
    DEFAULT_PRIORITY,
    KServeInput,
    build_call,
    dispatch,
    outputs_of,
)

__all__ = ["ImageGenerator", "ImageRequest"]


@dataclass(frozen=True, slots=True)
class ImageRequest:
    """One validated image request (frontends/openai_images.py builds it from the body)."""

    model: str
    prompt: str
    n: int
    width: int
    height: int
    seed: int | None = None
    priority: int | None = None
    deadline_ms: float | None = None
    client_id: str | None = None
    user: str | None = None

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    def as_dict(self) -> dict[str, Any]:
        """For a job record (JSON); `from_dict` reads it back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ImageRequest:
        return cls(**data)


def _inputs(request: ImageRequest) -> list[KServeInput]:
    prompt = serialize_bytes(np.array([request.prompt.encode()], dtype=object))
    seed = -1 if request.seed is None else request.seed
    return [
        KServeInput("prompt", "BYTES", (1,), prompt),
        KServeInput("size", "INT32", (2,), np.array([request.width, request.height], "<i4").tobytes()),
        KServeInput("n", "INT32", (1,), np.array([request.n], "<i4").tobytes()),
        KServeInput("seed", "INT64", (1,), np.array([seed], "<i8").tobytes()),
    ]


class ImageGenerator:
    """Runs `ImageRequest`s on the model pool; returns the PNG files."""

    def __init__(self, dispatcher: Dispatcher, limits: LimitsSettings, *, default_timeout_ms: float) -> None:
        self._dispatcher = dispatcher
        self._limits = limits
        self._default_timeout_ms = default_timeout_ms
        self._ids = itertools.count(1)

    async def generate(self, request: ImageRequest, *, request_id: str, client_id: str) -> list[bytes]:
        """The images, or a `LoadmasterError` (the engine's `invalid_argument` names the field).
        Cancelling the await cancels the request in the dispatcher."""
        call = build_call(
            _inputs(request),
            model_id=request.model,
            request_id=f"{request_id}-{next(self._ids)}",  # a re-run job gets a fresh call id
            client_id=client_id,
            priority=DEFAULT_PRIORITY if request.priority is None else request.priority,
            timeout_ms=request.deadline_ms or self._default_timeout_ms,
            limits=self._limits,
        )
        result = await dispatch(self._dispatcher, call)
        images = next((out for out in outputs_of(result) if out.name == "images"), None)
        if images is None or images.datatype != "BYTES" or len(images.shape) != 1:
            raise InternalError(f"model '{request.model}' did not answer with an `images` BYTES [n] output")
        return [bytes(png) for png in deserialize_bytes(images.data, images.shape[0], name="images")]
