"""Log probabilities of generated tokens, from the distribution the sampler draws from.

Two processors of ours around the sampling ones in transformers' per-request processor list
(`_seeded_sampling.py` has why the list is ours):

    GrammarMask -> LogprobCapture -> SamplingWarper -> SeededGumbelSampler -> ChosenTokenTap

`LogprobCapture` runs after the grammar mask (a token a grammar forbids has probability 0)
and, for the rows that asked for log probabilities only, computes the distribution the
sampler will draw from: the row's scores through the same `warp` (temperature, top_p) and a
log-softmax. A greedy row (temperature 0) draws the most likely token of its distribution at
temperature 1, and that distribution is the one reported (a point mass would say nothing).
A token outside top_p or forbidden by a grammar has log probability -inf (the gateway writes
OpenAI's -9999.0). `ChosenTokenTap` runs after the sampler, which leaves one finite score per
row: the drawn token. It records (token, its log probability, the k most likely) under the
sequence's id and the token's absolute position (prompt + generated, as the seeded sampler
keys its noise), so a preempted and resumed sequence finds each token's record.

Both run on the manager's thread in one step, `prepare_tensor_args` then `__call__` (the
synchronous batching the grammar mask also needs). `LogprobRecorder.take` runs on the event
loop when a token reaches its stream; the records are handed over under a lock. Rows that did
not ask cost one dict lookup per step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
)

from loadmaster.model_pool.engines._seeded_sampling import (
    WARP_KWARG,
    SamplingWarper,
    SeededGumbelSampler,
    pack_warp,
    warp,
)

__all__ = [
    "LOGPROBS_KWARG",
    "ChosenTokenTap",
    "LogprobCapture",
    "LogprobRecord",
    "LogprobRecorder",
    "install",
]

LOGPROBS_KWARG = "loadmaster_logprobs"  # per request: 0 = none, k + 1 = the token's and k alternatives
_TEMPERATURE_MASK = 0xFFFF


@dataclass(frozen=True, slots=True)
class LogprobRecord:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, log probability), most likely first


class LogprobRecorder:
    """Records by (sequence id, absolute position), written on the manager's thread."""

    def __init__(self) -> None:
        self._records: dict[str, dict[int, LogprobRecord]] = {}
        self._lock = threading.Lock()
        # one step's rows that asked: (row, request id, position, k), and their log probabilities
        self._rows: list[tuple[int, str, int, int]] = []
        self._logprobs: torch.Tensor | None = None

    def take(self, request_id: str, position: int) -> LogprobRecord | None:
        with self._lock:
            records = self._records.get(request_id)
            return None if records is None else records.pop(position, None)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._records.pop(request_id, None)

    @property
    def capturing(self) -> bool:
        """Whether this step's capture has rows waiting for their drawn tokens."""
        return bool(self._rows)

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(len(records) for records in self._records.values())

    # ---- the manager's thread --------------------------------------------------------

    def capture(self, rows: list[tuple[int, str, int, int]], logprobs: torch.Tensor | None) -> None:
        self._rows, self._logprobs = rows, logprobs

    def record(self, chosen: torch.Tensor) -> None:
        rows, logprobs = self._rows, self._logprobs
        self._rows, self._logprobs = [], None
        if logprobs is None:
            return
        records: list[tuple[str, int, LogprobRecord]] = []
        width = max(k for _, _, _, k in rows)
        top_values, top_tokens = (
            logprobs.topk(min(width, logprobs.size(-1)), dim=-1) if width else (None, None)
        )
        for line, (row, request_id, position, k) in enumerate(rows):
            token = int(chosen[row])
            top: tuple[tuple[int, float], ...] = ()
            if k and top_values is not None and top_tokens is not None:
                top = tuple(
                    (int(t), float(v))
                    for t, v in zip(top_tokens[line, :k].tolist(), top_values[line, :k].tolist(), strict=True)
                )
            records.append((request_id, position, LogprobRecord(token, float(logprobs[line, token]), top)))
        with self._lock:
            for request_id, position, record in records:
                self._records.setdefault(request_id, {})[position] = record


class LogprobCapture(ContinuousBatchingLogitsProcessor):
    """Before the warper: the log probabilities of the rows that asked (module docstring)."""

    supported_kwargs: dict[str, type] = {LOGPROBS_KWARG: int}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, recorder: LogprobRecorder) -> None:
        self._recorder = recorder
        self._rows: list[tuple[int, str, int, int]] = []
        self._packed: list[int] = []

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        self._rows, self._packed = [], []
        for row, request in enumerate(requests_with_new_token):
            state = request.state
            asked = int(state.logit_processor_kwargs.get(LOGPROBS_KWARG, 0))
            if asked <= 0:
                continue
            position = len(state.initial_tokens) + len(state.generated_tokens)
            self._rows.append((row, state.request_id, position, asked - 1))
            packed = int(state.logit_processor_kwargs.get(WARP_KWARG, pack_warp(1.0, 1.0)))
            if packed & _TEMPERATURE_MASK == 0:  # greedy: its distribution at temperature 1
                packed |= pack_warp(1.0, 0.0)
            self._packed.append(packed)
        return torch.zeros(len(requests_with_new_token), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        rows = [entry for entry in self._rows if entry[0] < scores.size(0)]
        if not rows:
            self._recorder.capture([], None)
            return scores
        index = torch.tensor([row for row, _, _, _ in rows], device=scores.device)
        packed = torch.tensor(self._packed[: len(rows)], dtype=torch.int32, device=scores.device)
        warped = warp(scores.index_select(0, index), packed, branch=scores.device.type == "cpu")
        self._recorder.capture(rows, torch.log_softmax(warped.float(), dim=-1).cpu())
        return scores


class ChosenTokenTap(ContinuousBatchingLogitsProcessor):
    """After the sampler (one finite score per row): records each asking row's drawn token."""

    supported_kwargs: dict[str, type] = {}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, recorder: LogprobRecorder) -> None:
        self._recorder = recorder

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        return torch.zeros(len(requests_with_new_token), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if self._recorder.capturing:
            self._recorder.record(scores.argmax(dim=-1).cpu())
        return scores


def install(processors: Any, recorder: LogprobRecorder) -> None:
    """Put the capture before our warper and the tap after our sampler (both installed
    already: `_seeded_sampling.install`), before the manager starts."""
    chain = processors.logits_processor
    warper = next(i for i, p in enumerate(chain) if isinstance(p, SamplingWarper))
    chain.insert(warper, LogprobCapture(recorder))
    sampler = next(i for i, p in enumerate(chain) if isinstance(p, SeededGumbelSampler))
    chain.insert(sampler + 1, ChosenTokenTap(recorder))
    processors.tensors_required += 2
    processors._retrieve_processors_kwargs()
    processors.do_processing = True
