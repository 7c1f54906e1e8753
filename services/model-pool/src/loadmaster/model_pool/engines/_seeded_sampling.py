"""Per-request sampling and seeds for transformers' continuous batching.

Two processors of ours replace transformers' per-request temperature/top-k/top-p
warpers (which sort the vocabulary twice per row per step and cost the tiny model more
than half its throughput here): `SamplingWarper` (temperature, top_p and greedy, from one
packed int32 per request; it sorts only when some row has top_p < 1), then
`SeededGumbelSampler`.

The manager seeds torch once (`ContinuousBatchingConfig.seed`) and draws every sampled
token of every sequence from that one generator with `torch.multinomial`, so what a
request samples depends on which other requests share its batches. This processor makes
the draw a function of the request alone: the Gumbel-max trick with noise computed from a
32-bit key per (request seed, token position). It runs last, after temperature, top-k and
top-p, keeps only the chosen token (the rest become -inf), so the manager's own
multinomial (or argmax: the engine builds the manager with `do_sample=False`) can only pick
that token. argmax(logits + Gumbel noise) is an exact sample
from softmax(logits); a token the warpers removed stays -inf and is never chosen.

The key uses the token's absolute position (prompt + generated), so a sequence re-submitted
with its generated tokens appended to the prompt (preemption by recompute) draws the same
tokens it would have drawn uninterrupted.

A request with `n` choices is one sequence that the manager forks after its prefill; the
forks (`<id>__child#<i>`) inherit its kwargs, so the sampler gives fork i the seed of choice
i + 1 (`choice_seed`): choice 0 draws what the same request with n = 1 draws, and a resumed
fork (re-submitted under a plain id) carries its choice's seed in its own kwargs (`for_choice`).

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

__all__ = [
    "CHILD_MARK",
    "SEED_KWARG",
    "WARP_KWARG",
    "SamplingWarper",
    "SeededGumbelSampler",
    "choice_seed",
    "for_choice",
    "install",
    "mix32",
    "pack_warp",
    "sample_key",
    "warp",
]

SEED_KWARG = "loadmaster_seed"  # the per-request kwargs the manager passes through
CHILD_MARK = "__child#"  # transformers names the forks of a sequence <its id>__child#<i>
_SEED_BITS = (1 << 63) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
WARP_KWARG = "loadmaster_warp"
_TEMPERATURE_SCALE = 1000  # temperature in thousandths (low 16 bits), 0 = greedy
_TOP_P_SCALE = 32767  # top_p in 1/32767ths (bits 16..30)
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


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request seeded `seed` (choice 0: the seed itself)."""
    return seed if choice == 0 else (seed + choice * _GOLDEN64) & _SEED_BITS


def for_choice(kwargs: dict[str, Any], choice: int) -> dict[str, Any]:
    """A request's sampling kwargs for one of its choices."""
    if choice == 0 or SEED_KWARG not in kwargs:
        return dict(kwargs)
    return {**kwargs, SEED_KWARG: choice_seed(int(kwargs[SEED_KWARG]), choice)}


def _row_seed(state: Any) -> int:
    seed = int(state.logit_processor_kwargs.get(SEED_KWARG, 0))
    request_id = state.request_id
    mark = request_id.rfind(CHILD_MARK)
    if mark < 0:
        return seed
    return choice_seed(seed, int(request_id[mark + len(CHILD_MARK) :]) + 1)


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
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # The top value, (2**24 - 0.5) / 2**24, rounds to 1.0 in float32 and would make the noise
    # +inf: a token the warpers or a grammar set to -inf (finite after nan_to_num) would then
    # win. Kept strictly below 1, so the noise is finite (at most ~16.6).
    uniform = uniform.clamp_(max=1.0 - 2.0**-24)  # in (0, 1)
    return -torch.log(-torch.log(uniform))


def pack_warp(temperature: float, top_p: float) -> int:
    """temperature (0..2, 0 = greedy) and top_p (0..1] in one non-negative int32."""
    return round(temperature * _TEMPERATURE_SCALE) | (round(top_p * _TOP_P_SCALE) << 16)


class SamplingWarper(ContinuousBatchingLogitsProcessor):
    """Temperature, nucleus (top_p) filtering and greedy rows, per request.

    On CPU a step whose rows are all greedy is left as it is and noted in `all_greedy`: the
    sampler then takes each row's argmax, which is what the warp and the noise would have
    chosen, without their dozen passes over the batch's logits (a tenth of a tiny model's step).
    """

    supported_kwargs: dict[str, type] = {WARP_KWARG: int}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.all_greedy = False  # this step's rows are all greedy (CPU only; set by __call__)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(pack_warp(1.0, 1.0))

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        default = pack_warp(1.0, 1.0)
        packed = [r.state.logit_processor_kwargs.get(WARP_KWARG, default) for r in requests_with_new_token]
        return torch.tensor(packed, dtype=torch.int32, device="cpu")

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        # On an accelerator the manager may capture this in a CUDA graph: no data-dependent
        # branches there (a captured branch would be replayed for every batch).
        packed = tensor_arg[: scores.size(0)]
        branch = scores.device.type == "cpu"
        self.all_greedy = branch and not bool(((packed.to(torch.int64) & 0xFFFF) != 0).any())
        if self.all_greedy:
            return scores
        return warp(scores, packed, branch=branch)


def warp(scores: torch.Tensor, packed_args: torch.Tensor, *, branch: bool) -> torch.Tensor:
    """Temperature, top_p and greedy rows; `branch` skips the unused steps (CPU only)."""
    packed = packed_args.to(torch.int64)
    temperature = (packed & 0xFFFF).to(torch.float32) / _TEMPERATURE_SCALE
    top_p = (packed >> 16).to(torch.float32) / _TOP_P_SCALE
    greedy = temperature == 0
    scores = scores.float() / torch.where(greedy, 1.0, temperature).unsqueeze(-1)
    if not branch or bool((top_p < 1.0).any()):
        ordered, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p).unsqueeze(-1)
        drop[..., -1:] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if not branch or bool(greedy.any()):
        best = scores.argmax(dim=-1, keepdim=True)
        others = torch.ones_like(scores, dtype=torch.bool).scatter_(-1, best, False)
        scores = scores.masked_fill(others & greedy.unsqueeze(-1), float("-inf"))
    return scores


class SeededGumbelSampler(ContinuousBatchingLogitsProcessor):
    """Keeps one token per row: argmax(scores + noise(key)). Key 0 is a valid key.

    Behind a `warper` that found every row greedy, no noise: argmax(scores)."""

    supported_kwargs: dict[str, type] = {SEED_KWARG: int}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, warper: SamplingWarper | None = None) -> None:
        self.warper = warper

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        keys = []
        for request in requests_with_new_token:
            state = request.state
            position = len(state.initial_tokens) + len(state.generated_tokens)
            key = sample_key(_row_seed(state), position)
            keys.append(key - (1 << 32) if key >= (1 << 31) else key)  # stored as int32
        return torch.tensor(keys, dtype=torch.int32, device="cpu")

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        logits = torch.nan_to_num(scores.float(), nan=float("-inf"))
        if self.warper is not None and self.warper.all_greedy:
            chosen = logits.argmax(dim=-1, keepdim=True)
        else:
            keys = tensor_arg[: scores.size(0)].to(torch.int64) & _MASK32
            chosen = (logits + gumbel_noise(keys, scores.size(-1))).argmax(dim=-1, keepdim=True)
        # One finite score per row, 0 at the chosen token: a row whose logits are all -inf
        # or NaN (seen for a sequence preempted mid-step) still hands the manager's
        # multinomial a valid distribution instead of killing its generation loop.
        return torch.full_like(scores, float("-inf")).scatter_(-1, chosen, 0.0)


def install(processors: Any) -> None:
    """Append warper and sampler to a manager's `ContinuousBatchingLogitsProcessorList`
    (before start; build the manager with no sampling warpers of its own)."""
    warper = SamplingWarper()
    processors.logits_processor.append(warper)
    processors.logits_processor.append(SeededGumbelSampler(warper))
    processors.tensors_required += 2
    processors._retrieve_processors_kwargs()
    processors.do_processing = True
