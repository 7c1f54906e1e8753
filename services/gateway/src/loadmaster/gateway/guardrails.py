"""Guardrails on the OpenAI API: blocklists on prompts and completions, and a policy webhook.

- `Blocklist` (pure): configured words (whole words, any case) and regular expressions.
- `StreamScreen` (pure): checks a completion as its chunks arrive. It holds back the last
  `holdback` characters, at least as many as the longest blocked word, so a blocked word
  split across chunks (`"forbid"`, `"den"`) is caught before any of it is sent. A match
  that ends exactly at the end of the text so far waits for the next character (`"den"`
  could still become `"denial"`). Each chunk rescans only the held text plus a tail of
  what was sent: the cost per chunk does not grow with the completion.
- `Guardrails`: refuses a prompt that matches (`PolicyRefusedError`: HTTP 400, code
  `policy_refused`), asks the webhook, and wraps a generation's events so that a completion
  that matches stops there with finish_reason `content_filter` (OpenAI's name for it).

A prompt longer than `INLINE_CHARS` is scanned on the validation threads, off the event loop.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from loadmaster.common.errors import InvalidArgumentError, UnavailableError
from loadmaster.common.gateway_config import GuardrailSettings
from loadmaster.gateway.auth import Principal
from loadmaster.gateway.generation import Finished, GenerationEvent, GenerationRequest, TextChunk, Waiting
from loadmaster.gateway.validation import off_loop

__all__ = [
    "CONTENT_FILTER",
    "BlockMatch",
    "Blocklist",
    "Guardrails",
    "PolicyRefusedError",
    "PolicyUnavailableError",
    "StreamScreen",
    "prompt_text",
]

log = logging.getLogger(__name__)

CONTENT_FILTER = "content_filter"  # OpenAI's finish_reason for a completion its filter stopped
INLINE_CHARS = 2048  # prompts up to this many characters are scanned on the event loop (< 1 ms)


class PolicyRefusedError(InvalidArgumentError):
    """The request was refused by policy (a blocklist, or the policy webhook said no)."""

    @property
    def edge_code(self) -> str:
        return "policy_refused"


class PolicyUnavailableError(UnavailableError):
    """The policy webhook did not answer, and the gateway is configured to fail closed."""

    @property
    def edge_code(self) -> str:
        return "policy_unavailable"


@dataclass(frozen=True, slots=True)
class BlockMatch:
    rule: str  # `blocked_words` or `blocked_patterns[i]`: names the rule, never the text
    start: int
    end: int


class Blocklist:
    def __init__(self, words: Sequence[str], patterns: Sequence[str]) -> None:
        words = sorted({w for w in words if w}, key=len, reverse=True)
        self._words: tuple[re.Pattern[str], re.Pattern[str]] | None = None
        if words:
            # Matched on the lower-cased text (3x faster than IGNORECASE); a text whose length
            # lower-casing changes (a few letters, such as 'İ') takes the IGNORECASE form.
            lowered = "|".join(re.escape(w.lower()) for w in words)
            alternatives = "|".join(re.escape(w) for w in words)
            self._words = (
                re.compile(rf"(?<!\w)(?:{lowered})(?!\w)"),
                re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE),
            )
        self._patterns = [(f"blocked_patterns[{i}]", re.compile(p)) for i, p in enumerate(patterns)]
        self.longest_word = len(words[0]) if words else 0
        self.has_patterns = bool(patterns)

    def __bool__(self) -> bool:
        return self._words is not None or bool(self._patterns)

    def find(self, text: str, *, final: bool = True) -> BlockMatch | None:
        """The first match in `text`; unless `final`, one that ends at the end of `text` does not
        count yet (the next character may undo it)."""
        rules: list[tuple[str, re.Pattern[str], str]] = []
        if self._words is not None:
            lowered = text.lower()
            same = len(lowered) == len(text)
            rules.append(
                ("blocked_words", self._words[0] if same else self._words[1], lowered if same else text)
            )
        rules += [(rule, pattern, text) for rule, pattern in self._patterns]
        found: BlockMatch | None = None
        for rule, pattern, subject in rules:
            for match in pattern.finditer(subject):
                if not final and match.end() >= len(subject):
                    break
                if found is None or match.start() < found.start:
                    found = BlockMatch(rule, match.start(), match.end())
                break
        return found


class StreamScreen:
    """A completion checked as it arrives: `feed` each chunk, then `finish`; each returns the
    text now safe to send and the match that stopped it, if any (then send nothing more)."""

    def __init__(self, blocklist: Blocklist, *, holdback: int) -> None:
        self._blocklist = blocklist
        self._holdback = max(1, holdback, blocklist.longest_word)
        self._sent_tail = ""  # the last characters sent, for matches' left context
        self._held = ""

    def feed(self, text: str) -> tuple[str, BlockMatch | None]:
        self._held += text
        return self._check(final=False)

    def finish(self) -> tuple[str, BlockMatch | None]:
        return self._check(final=True)

    def _check(self, *, final: bool) -> tuple[str, BlockMatch | None]:
        window = self._sent_tail + self._held
        match = self._blocklist.find(window, final=final)
        if match is not None:
            safe = max(0, match.start - len(self._sent_tail))  # the held text before the match
            released, self._held = self._held[:safe], ""
            return released, match
        cut = len(self._held) if final else max(0, len(self._held) - self._holdback)
        released, self._held = self._held[:cut], self._held[cut:]
        self._sent_tail = (self._sent_tail + released)[-self._holdback :]
        return released, None


def prompt_text(generation: GenerationRequest) -> str:
    """The text a request asks about: its messages' contents, one per line, or its prompt."""
    if generation.messages is not None:
        return "\n".join(turn.content for turn in generation.messages)
    return generation.prompt or ""


class Guardrails:
    def __init__(self, settings: GuardrailSettings, *, http: httpx.AsyncClient | None = None) -> None:
        self._settings = settings
        self.blocklist = Blocklist(settings.blocked_words, settings.blocked_patterns)
        self._holdback = self._holdback_for(self.blocklist)
        self._webhook = settings.webhook
        self._http = http

    def _holdback_for(self, blocklist: Blocklist) -> int:
        return max(
            blocklist.longest_word, self._settings.stream_holdback_chars if blocklist.has_patterns else 0
        )

    def use_blocklist(self, blocklist: Blocklist) -> None:
        """Check with `blocklist` from now on (the admin plane builds it off the event loop;
        a stream already being screened keeps the list it started with)."""
        self.blocklist, self._holdback = blocklist, self._holdback_for(blocklist)

    @property
    def screens_completions(self) -> bool:
        return self._settings.check_completions and bool(self.blocklist)

    async def admit(
        self,
        generation: GenerationRequest,
        *,
        request_id: str,
        principal: Principal,
        client_id: str,
        endpoint: str,
    ) -> None:
        """Raise `PolicyRefusedError` when the prompt matches a blocklist or the webhook says no."""
        if self._settings.check_prompts and self.blocklist:
            text = prompt_text(generation)
            find = self.blocklist.find
            match = find(text) if len(text) <= INLINE_CHARS else await off_loop(find, text)
            if match is not None:
                log.info("request %s refused by policy: the prompt matches %s", request_id, match.rule)
                raise PolicyRefusedError(f"the prompt was refused by policy ({match.rule})")
        if self._webhook.url:
            await self._ask_webhook(
                generation, request_id=request_id, principal=principal, client_id=client_id, endpoint=endpoint
            )

    async def _ask_webhook(
        self,
        generation: GenerationRequest,
        *,
        request_id: str,
        principal: Principal,
        client_id: str,
        endpoint: str,
    ) -> None:
        text = prompt_text(generation)
        digest = _sha256(text) if len(text) <= INLINE_CHARS else await off_loop(_sha256, text)
        metadata = {
            "request_id": request_id,
            "endpoint": endpoint,
            "model": generation.model,
            "subject": principal.name,
            "auth": principal.method,
            "client_id": client_id,
            "priority": generation.priority,
            "stream": generation.stream,
            "max_tokens": generation.max_tokens,
            "messages": len(generation.messages or ()),
            "prompt_chars": len(text),
            "prompt_sha256": digest,
        }
        try:
            if self._http is None:
                self._http = httpx.AsyncClient()
            reply = await self._http.post(
                self._webhook.url, json=metadata, timeout=self._webhook.timeout_ms / 1000
            )
            reply.raise_for_status()
            allow, reason = _decision(reply.json())
        except (httpx.HTTPError, ValueError) as error:
            problem = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            if self._webhook.fail_open:
                log.warning(
                    "policy webhook failed (%s); allowing request %s (fail_open)", problem, request_id
                )
                return
            log.warning("policy webhook failed (%s); refusing request %s (fail closed)", problem, request_id)
            raise PolicyUnavailableError(
                f"the policy service did not answer ({problem}); try again"
            ) from None
        if not allow:
            log.info("request %s refused by the policy webhook: %s", request_id, reason or "no reason given")
            raise PolicyRefusedError(f"refused by policy: {reason}" if reason else "refused by policy")

    async def screen(self, events: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
        """`events` with the completion checked as it goes: text is sent once it cannot be part
        of a match; on a match the generation is closed (cancelled) and a `Finished` with
        `content_filter` ends it. Token counts are then what arrived: a chunk per token."""
        screens: dict[int, StreamScreen] = {}  # one per choice (n > 1)
        chunks = 0
        try:
            async for item in events:
                if isinstance(item, Waiting):
                    yield item
                    continue
                if isinstance(item, TextChunk):
                    chunks += 1
                    screen = screens.setdefault(
                        item.choice, StreamScreen(self.blocklist, holdback=self._holdback)
                    )
                    released, match = screen.feed(item.text)
                    if released or item.tool_calls or item.logprobs:  # calls and logprobs pass as they come
                        yield replace(item, text=released)
                    if match is not None:
                        log.info("a completion was stopped by policy: it matches %s", match.rule)
                        yield Finished(CONTENT_FILTER, prompt_tokens=0, completion_tokens=chunks)
                        return
                    continue
                for choice, screen in sorted(screens.items()):
                    released, match = screen.finish()
                    if released:
                        yield TextChunk(released, choice=choice)
                    if match is not None:
                        log.info("a completion was stopped by policy: it matches %s", match.rule)
                        item = replace(item, finish_reason=CONTENT_FILTER)
                yield item
                return
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _decision(body: Any) -> tuple[bool, str]:
    """`{"allow": bool, "reason": str}`, or OPA's `{"result": bool}` / `{"result": {"allow": ...}}`."""
    if isinstance(body, dict) and isinstance(body.get("result"), (bool, dict)):
        body = body["result"] if isinstance(body["result"], dict) else {"allow": body["result"]}
    if not isinstance(body, dict) or not isinstance(body.get("allow"), bool):
        raise ValueError('the policy webhook must answer {"allow": true|false}')
    reason = body.get("reason")
    return body["allow"], reason if isinstance(reason, str) else ""
