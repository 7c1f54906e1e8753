"""Pure pieces of generation: parameter checks, stop strings across chunks, seeded sampling."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines._seeded_sampling import (
    SamplingWarper,
    SeededGumbelSampler,
    gumbel_noise,
    mix32,
    pack_warp,
    sample_key,
    warp,
)
from loadmaster.model_pool.engines._token_streams import StreamState
from loadmaster.model_pool.generation import (
    FinishReason,
    GenerationEnd,
    SamplingParams,
    StopMatcher,
    TokenChunk,
)


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_string_split_over_chunks_is_found_and_not_emitted() -> None:
    assert feed_all(StopMatcher(["END"]), ["abc E", "N", "D tail"]) == ("abc ", True)


def test_held_back_text_is_released_when_it_cannot_be_a_stop() -> None:
    matcher = StopMatcher(["END"])
    assert matcher.feed("abc EN") == ("abc ", False)  # "EN" may start "END"
    assert matcher.feed("X") == ("ENX", False)
    assert feed_all(StopMatcher(["END"]), ["abc EN"]) == ("abc EN", False)  # flushed at the end


def test_earliest_of_several_stops_wins() -> None:
    assert feed_all(StopMatcher(["zz", "b"]), ["a", "bzz"]) == ("a", True)


def test_no_stops_passes_text_through() -> None:
    assert StopMatcher([]).feed("anything") == ("anything", False)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(max_tokens=True), "max_tokens"),
        (SamplingParams(max_tokens=4, temperature=float("nan")), "temperature"),
        (SamplingParams(max_tokens=4, top_p=1.5), "top_p"),
        (SamplingParams(max_tokens=4, seed=1 << 70), "seed"),
    ],
)
def test_bad_sampling_params_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        params.check()


def test_sample_keys_are_deterministic_and_spread() -> None:
    assert sample_key(7, 3) == sample_key(7, 3)
    keys = {sample_key(seed, position) for seed in range(20) for position in range(50)}
    assert len(keys) == 1000
    assert mix32(0) == 0 and mix32(1) != 1


def test_noise_matches_between_python_keys_and_tensor_hash() -> None:
    keys = torch.tensor([sample_key(1, 2), sample_key(3, 4)], dtype=torch.int64)
    noise = gumbel_noise(keys, 64)
    assert noise.shape == (2, 64) and torch.isfinite(noise).all()
    assert torch.equal(noise, gumbel_noise(keys, 64))
    assert not torch.equal(noise[0], noise[1])


def test_seeded_sampler_draws_from_the_softmax_and_keeps_one_token() -> None:
    sampler = SeededGumbelSampler()
    logits = torch.log(torch.tensor([0.25, 0.75, 0.0]))  # the last token was filtered (-inf)
    rows = 4000
    keys = torch.tensor([sample_key(seed, 5) for seed in range(rows)], dtype=torch.int64)
    args = torch.where(keys >= (1 << 31), keys - (1 << 32), keys).to(torch.int32)
    out = sampler(logits.repeat(rows, 1), args)
    kept = torch.isfinite(out)
    assert (kept.sum(dim=-1) == 1).all()
    chosen = kept.float().argmax(dim=-1)
    assert not (chosen == 2).any()
    share = (chosen == 1).float().mean().item()
    assert 0.72 < share < 0.78  # 0.75 expected; 4000 draws: sd 0.007


def test_seeded_sampler_gives_a_valid_distribution_for_a_row_without_finite_logits() -> None:
    scores = torch.tensor([[float("nan")] * 3, [float("-inf")] * 3, [0.0, 5.0, float("nan")]])
    out = SeededGumbelSampler()(scores, torch.tensor([1, 2, 3], dtype=torch.int32))
    probabilities = out.softmax(dim=-1)
    assert torch.isfinite(probabilities).all() and (torch.isfinite(out).sum(dim=-1) == 1).all()
    torch.multinomial(probabilities, 1)  # what raised in the manager's loop


def test_warper_applies_greedy_top_p_and_temperature_per_row() -> None:
    warper = SamplingWarper()
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]] * 3))
    args = torch.tensor([pack_warp(0.0, 1.0), pack_warp(1.0, 0.5), pack_warp(2.0, 1.0)], dtype=torch.int32)
    out = warper(logits, args)
    assert torch.isfinite(out[0]).tolist() == [False, False, True]  # greedy: the argmax only
    assert torch.isfinite(out[1]).tolist() == [False, False, True]  # top_p 0.5: the 0.7 token covers it
    assert torch.allclose(out[2], logits[2] / 2.0)  # temperature 2, nothing filtered


# ---- StreamState: the manager's cumulative outputs -> chunks + one terminal ------------


class ByteTokenizer:
    """Token i (1..255) is byte i; token 0 is eos (special, skipped)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i != 0).decode("utf-8", errors="replace")


@dataclass
class Output:
    generated_tokens: list[int]
    finished: bool = False
    error: str | None = None
    request_id: str = "r#1"

    def is_finished(self) -> bool:
        return self.finished


def stream_state(stop: tuple[str, ...] = (), max_tokens: int = 16) -> tuple[StreamState, list[str]]:
    cancelled: list[str] = []
    state = StreamState(
        request_id="r",
        internal_id="r#1",
        prompt_tokens=3,
        params=SamplingParams(max_tokens=max_tokens, stop=stop),
        tokenizer=ByteTokenizer(),
        eos_ids=frozenset({0}),
        on_done=lambda s: None,
        cancel_in_manager=cancelled.append,
        loop=asyncio.new_event_loop(),
    )
    return state, cancelled


def drain(state: StreamState) -> list[Any]:
    events = []
    while not state.events.empty():
        events.append(state.events.get_nowait())
    state.loop.close()
    return events


def test_eos_ends_with_stop_and_a_split_character_is_emitted_whole() -> None:
    state, _ = stream_state()
    euro = list("€".encode())  # three bytes, three tokens
    state.on_output(Output([ord("a"), euro[0]]))
    state.on_output(Output([ord("a"), *euro[:2]]))
    state.on_output(Output([ord("a"), *euro, 0], finished=True))
    events = drain(state)
    assert [e.text for e in events if isinstance(e, TokenChunk) and e.text] == ["a", "€"]  # never "\ufffd"
    assert [e.sequence for e in events] == list(range(len(events)))
    end = events[-1]
    assert isinstance(end, GenerationEnd) and end.finish_reason is FinishReason.STOP
    assert end.usage.completion_tokens == 5 and end.usage.prompt_tokens == 3


def test_stop_string_cancels_the_sequence_and_nothing_follows_the_terminal() -> None:
    state, cancelled = stream_state(stop=("cd",))
    state.on_output(Output([ord(c) for c in "abc"]))
    state.on_output(Output([ord(c) for c in "abcde"]))
    state.on_output(Output([ord(c) for c in "abcdef"], finished=True))  # ignored: already ended
    state.on_output(Output([ord(c) for c in "xyz"], request_id="r#0"))  # ignored: an older submission
    state.cancel()  # ignored too
    events = drain(state)
    assert "".join(e.text for e in events if isinstance(e, TokenChunk)) == "ab"
    assert [type(e).__name__ for e in events].count("GenerationEnd") == 1
    assert events[-1].finish_reason is FinishReason.STOP
    assert cancelled == ["r#1"]


def test_length_and_error_terminals() -> None:
    state, _ = stream_state(max_tokens=2)
    state.on_output(Output([ord("x"), ord("y")], finished=True))
    assert drain(state)[-1].finish_reason is FinishReason.LENGTH
    state, _ = stream_state()
    state.on_output(Output([], finished=True, error="cache allocation failed"))
    (end,) = drain(state)
    assert end.finish_reason is FinishReason.ERROR and "cache allocation" in end.error


def test_warper_branch_free_path_gives_the_same_answer() -> None:
    # The path taken on accelerators (no data-dependent branches, CUDA-graph safe) must agree
    # with the CPU one, batch by batch: all default rows, all greedy, and mixed.
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    for rows in (
        [pack_warp(1.0, 1.0)] * 4,
        [pack_warp(0.0, 1.0)] * 4,
        [pack_warp(1.0, 1.0), pack_warp(0.0, 1.0), pack_warp(0.7, 0.9), pack_warp(1.3, 1.0)],
    ):
        args = torch.tensor(rows, dtype=torch.int32)
        assert torch.equal(warp(logits, args, branch=True), warp(logits, args, branch=False))


def test_an_all_greedy_step_skips_the_warp_and_the_noise_and_picks_the_same_tokens() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    logits[2, 7] = float("nan")  # a broken row still yields one finite score
    keys = torch.arange(6, dtype=torch.int32)
    warper = SamplingWarper()
    paired = SeededGumbelSampler(warper)
    greedy = torch.tensor([pack_warp(0.0, 1.0)] * 6, dtype=torch.int32)
    fast = paired(warper(logits, greedy), keys)
    assert warper.all_greedy
    full = SeededGumbelSampler()(warp(logits, greedy, branch=True), keys)
    healthy = [0, 1, 3, 4, 5]  # the NaN row's pick was arbitrary before and is now its best number
    assert torch.equal(fast.argmax(dim=-1)[healthy], full.argmax(dim=-1)[healthy])
    assert (torch.isfinite(fast).sum(dim=-1) == 1).all()
    mixed = greedy.clone()
    mixed[3] = pack_warp(1.0, 1.0)  # one sampled row: the whole step takes the full path
    warper(logits, mixed)
    assert not warper.all_greedy


def _unmix32(value: int) -> int:
    """The inverse of murmur3's 32-bit finaliser (`mix32`)."""
    value ^= value >> 16
    value = (value * 0x7ED1B41D) & 0xFFFFFFFF
    value ^= (value >> 13) ^ (value >> 26)
    value = (value * 0xA5CB9243) & 0xFFFFFFFF
    return value ^ (value >> 16)


def test_gumbel_noise_is_finite_so_a_removed_token_is_never_drawn() -> None:
    """The key whose hash is all ones drew +inf noise at token 0, and the sampler then chose
    token 0 although a warper (or a structured-output grammar) had set it to -inf."""
    key = _unmix32(0xFFFFFFFF)
    assert mix32(key) == 0xFFFFFFFF
    noise = gumbel_noise(torch.tensor([key]), 4)
    assert torch.isfinite(noise).all()
    scores = torch.tensor([[float("-inf"), -3.0, float("-inf"), float("-inf")]])
    chosen = SeededGumbelSampler()(scores, torch.tensor([key], dtype=torch.int32))
    assert torch.isfinite(chosen[0]).nonzero().flatten().tolist() == [1]
