"""Per-request seeds for transformers' continuous batching.

The manager seeds torch once (`ContinuousBatchingConfig.seed`) and draws every sampled
token of every sequence from that one generator with `torch.multinomial`, so what a
request samples depends on which other requests share its batches. This processor makes
the draw a function of the request alone: the Gumbel-max trick with noise computed from a
32-bit key per (request seed, token position). It runs last, after temperature, top-k and
top-p, keeps only the chosen token (the rest become -inf), so the manager's own
multinomial can only pick that token. argmax(logits + Gumbel noise) is an exact sample
from softmax(logits); a token the warpers removed stays -inf and is never chosen.

The key uses the token's absolute position (prompt + generated), so a sequence re-submitted
with its generated tokens appended to the prompt (preemption by recompute) draws the same
tokens it would have drawn uninterrupted.

It plugs into the manager's `ContinuousBatchingLogitsProcessorList` (transformers 5.24's
per-request processor API, `per_request_processors=True`); `install` must run before the
manager starts. Tested by the engine's tests (greedy = `generate`, seeds reproduce).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
)

__all__ = ["SEED_KWARG", "SeededGumbelSampler", "install", "mix32", "sample_key"]

SEED_KWARG = "loadmaster_seed"  # the per-request kwarg the manager passes through
_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_C1 = 0x85EBCA6B
_C2 = 0xC2B2AE35


def mix32(value: int) -> int:
    """murmur3's 32-bit finaliser, on Python ints."""
    value &= _MASK32
    value ^= value >> 16
    value = (value * _C1) & _MASK32
    value ^= value >> 13
    value = (value * _C2) & _MASK32
    return value ^ (value >> 16)


def sample_key(seed: int, position: int) -> int:
    """The 32-bit key of the token at `position` of a sequence seeded with `seed`."""
    folded = (seed ^ (seed >> 32)) & _MASK32
    return mix32(mix32(folded) ^ ((position * _GOLDEN) & _MASK32))


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    # (x * constant) mod 2**32 in int64 without overflow: split the constant in 16-bit halves.
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B] int64 keys -> [B, V] float32 standard Gumbel noise, the same on every device."""
    index = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    bits = _mix32_tensor((keys.unsqueeze(-1) ^ _mul32(index, _GOLDEN).unsqueeze(0)) & _MASK32)
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(-torch.log(uniform))


class SeededGumbelSampler(ContinuousBatchingLogitsProcessor):
    """Keeps one token per row: argmax(scores + noise(key)). Key 0 is a valid key."""

    supported_kwargs: dict[str, type] = {SEED_KWARG: int}
    ignored_kwargs: tuple[str, ...] = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        keys = []
        for request in requests_with_new_token:
            state = request.state
            position = len(state.initial_tokens) + len(state.generated_tokens)
            key = sample_key(int(state.logit_processor_kwargs.get(SEED_KWARG, 0)), position)
            keys.append(key - (1 << 32) if key >= (1 << 31) else key)  # stored as int32
        return torch.tensor(keys, dtype=torch.int32, device="cpu")

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        keys = tensor_arg[: scores.size(0)].to(torch.int64) & _MASK32
        noisy = scores.float() + gumbel_noise(keys, scores.size(-1))
        chosen = noisy.argmax(dim=-1, keepdim=True)
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
        return scores.masked_fill(~keep, float("-inf"))


def install(processors: Any) -> None:
    """Append the sampler to a manager's `ContinuousBatchingLogitsProcessorList` (before start)."""
    processors.logits_processor.append(SeededGumbelSampler())
    processors.tensors_required += 1
    processors._retrieve_processors_kwargs()
    processors.do_processing = True
