"""Blocklists, the stream screen and the webhook's answers (pure parts; no sockets)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from loadmaster.common.gateway_config import GuardrailSettings
from loadmaster.gateway.generation import Finished, GenerationEvent, TextChunk
from loadmaster.gateway.generation_items import TokenLogprob, ToolCall
from loadmaster.gateway.guardrails import (
    Blocklist,
    Guardrails,
    PolicyRefusedError,
    StreamScreen,
    _decision,
)

WORDS = ["forbidden", "top secret"]
PATTERNS = [r"\bkey-\d{4}\b"]


def screened(pieces: list[str], *, holdback: int = 0) -> tuple[str, str | None]:
    screen = StreamScreen(Blocklist(WORDS, PATTERNS), holdback=holdback)
    sent = []
    for piece in pieces:
        released, match = screen.feed(piece)
        sent.append(released)
        if match is not None:
            return "".join(sent), match.rule
    released, match = screen.finish()
    sent.append(released)
    return "".join(sent), match.rule if match else None


def test_words_match_whole_words_in_any_case_and_patterns_as_written() -> None:
    blocklist = Blocklist(WORDS, PATTERNS)
    assert blocklist.find("this is FORBIDDEN.") is not None
    assert blocklist.find("Top Secret plans") is not None
    assert blocklist.find("unforbidden forbiddenly top secrets") is None
    match = blocklist.find("use key-1234 now")
    assert match is not None and match.rule == "blocked_patterns[0]"
    assert blocklist.find("key-12345") is None


def test_a_word_split_across_chunks_is_caught_before_any_of_it_is_sent() -> None:
    assert screened(["safe text ", "for", "bid", "den", " more"]) == ("safe text ", "blocked_words")
    assert screened(["top sec", "ret"]) == ("", "blocked_words")  # caught at the end of the stream


def test_a_match_at_the_end_waits_for_the_next_character() -> None:
    assert screened(["it is forbidden", "ly fine"]) == ("it is forbiddenly fine", None)
    assert screened(["key-1234", "5"]) == ("key-12345", None)


def test_the_screen_sends_everything_but_the_holdback_as_it_goes() -> None:
    screen = StreamScreen(Blocklist(WORDS, []), holdback=0)  # the longest word (10) is the floor
    released, match = screen.feed("abcdefghijklmnopqrstuvwxyz")
    assert match is None and released == "abcdefghijklmnop"
    assert screen.finish() == ("qrstuvwxyz", None)


def test_random_chunkings_never_leak_a_blocked_word() -> None:
    rng = random.Random(7)
    text = "a fine day; then the forbidden thing, and more words after it"
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 20)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        sent, rule = screened(pieces, holdback=rng.randint(0, 12))
        assert rule == "blocked_words" and sent == "a fine day; then the "


async def test_screen_stops_the_generation_with_content_filter_and_closes_it() -> None:
    closed = []

    async def events() -> AsyncIterator[GenerationEvent]:
        try:
            for piece in ["ok ", "forb", "idden", " rest"]:
                yield TextChunk(piece)
            yield Finished("stop", prompt_tokens=3, completion_tokens=4)
        finally:
            closed.append(True)

    guard = Guardrails(GuardrailSettings(blocked_words=WORDS))
    out = [item async for item in guard.screen(events())]
    assert "".join(i.text for i in out if isinstance(i, TextChunk)) == "ok "
    assert out[-1] == Finished("content_filter", prompt_tokens=0, completion_tokens=4)  # chunks seen
    assert closed == [True]


async def test_screen_passes_a_clean_completion_whole_with_its_finish() -> None:
    async def events() -> AsyncIterator[GenerationEvent]:
        yield TextChunk("all ")
        yield TextChunk("fine")
        yield Finished("length", prompt_tokens=3, completion_tokens=2, model="m")

    guard = Guardrails(GuardrailSettings(blocked_words=WORDS))
    out = [item async for item in guard.screen(events())]
    assert "".join(i.text for i in out if isinstance(i, TextChunk)) == "all fine"
    assert out[-1] == Finished("length", prompt_tokens=3, completion_tokens=2, model="m")


async def test_screen_keeps_each_choice_apart_and_passes_tool_calls_and_logprobs() -> None:
    call = ToolCall("call_1", "f", "{}")
    logprob = TokenLogprob("a", b"a", -0.5)

    async def events() -> AsyncIterator[GenerationEvent]:
        yield TextChunk("all ", logprobs=(logprob,))
        yield TextChunk("other ", choice=1)
        yield TextChunk("", choice=1, tool_calls=(call,))
        yield TextChunk("fine")
        yield Finished("stop", prompt_tokens=3, completion_tokens=4)

    guard = Guardrails(GuardrailSettings(blocked_words=WORDS))
    out = [item async for item in guard.screen(events())]
    chunks = [i for i in out if isinstance(i, TextChunk)]
    assert "".join(i.text for i in chunks if i.choice == 0) == "all fine"
    assert "".join(i.text for i in chunks if i.choice == 1) == "other "
    assert [c for i in chunks for c in i.tool_calls] == [call] and [
        lp for i in chunks for lp in i.logprobs
    ] == [logprob]


def test_a_refusal_is_a_400_with_the_policy_code() -> None:
    error = PolicyRefusedError("refused by policy")
    assert (error.http_status, error.edge_code) == (400, "policy_refused")


@pytest.mark.parametrize(
    ("body", "decision"),
    [
        ({"allow": True}, (True, "")),
        ({"allow": False, "reason": "no"}, (False, "no")),
        ({"result": True}, (True, "")),
        ({"result": {"allow": False, "reason": "opa says no"}}, (False, "opa says no")),
    ],
)
def test_webhook_answers(body: object, decision: tuple[bool, str]) -> None:
    assert _decision(body) == decision


@pytest.mark.parametrize("body", [{}, {"allow": "yes"}, [], {"result": "maybe"}])
def test_a_webhook_answer_without_a_decision_is_an_error(body: object) -> None:
    with pytest.raises(ValueError, match="allow"):
        _decision(body)


def test_a_bad_pattern_is_a_configuration_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"blocked_patterns\[1\] is not a regular expression"):
        GuardrailSettings(blocked_patterns=["ok", "(unclosed"])


def test_a_text_whose_length_lower_casing_changes_still_matches_in_the_right_place() -> None:
    blocklist = Blocklist(WORDS, [])
    text = "İİ FORBIDDEN"  # 'İ'.lower() is two characters
    match = blocklist.find(text)
    assert match is not None and text[match.start : match.end] == "FORBIDDEN"
    assert screened(["İ ok ", "FORB", "IDDEN x"]) == ("İ ok ", "blocked_words")
