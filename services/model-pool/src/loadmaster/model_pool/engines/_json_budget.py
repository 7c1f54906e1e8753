"""A structured reply that always ends complete: the token budget of one constrained sequence.

Each constrained sequence keeps a `Plan`, a verified way to finish its JSON value from where
it stands (the closing bytes `Closer` found, as model tokens), and the invariant

    plan.need  <=  remaining          (need = plan tokens + the end-of-sequence token;
                                        remaining = max_tokens - tokens generated)

which holds at the start or the request is refused (`shortest` > max_tokens: a 400 naming
max_tokens before anything is queued). Each step keeps it:

- no slack (`need >= remaining`): the step must follow the plan, so the mask allows only its
  next token (`forced`);
- otherwise the model samples under the grammar mask, and the sampled token is checked
  (`approve`, after the sampler): the plan of the state it leads to must fit in one token
  less. That plan comes from the cheapest source that works: the old plan when the token
  is its next token or spells its first bytes; the old closing bytes, or a suffix of them,
  when they still close after the token, maybe after finishing what it leaves open (a UTF-8
  character, a number, an enum value) -- `_repairs`, checked with `validate_tokens`, tens
  of microseconds; else a fresh search (0-2 % of tokens in the bench).
  A token whose plan does not fit is replaced by the plan's next token (the end of sequence
  when the value is complete), which fits by the invariant.

So every reply whose budget admits a valid value ends as one, parses and validates, and the
model chooses freely until its budget says otherwise. Plans are shortest in bytes (the
search's unit) and counted in tokens with longest-match tokenization, so "fits" can be a
token or two more cautious than the true token minimum.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from loadmaster.model_pool.engines._json_closing import Closer

__all__ = ["Budget", "Plan", "Vocabulary"]

log = logging.getLogger(__name__)
_MARGIN = 4  # a repaired plan this close to the budget is searched again (it may be longer)


def _utf8_rest(data: bytes) -> bytes:
    """The shortest bytes that finish a UTF-8 character `data` ends inside of (b"" if none)."""
    for back in range(1, min(4, len(data)) + 1):
        lead = data[-back]
        if lead & 0xC0 == 0x80:
            continue  # a continuation byte: look further back
        size = 2 if lead & 0xE0 == 0xC0 else 3 if lead & 0xF0 == 0xE0 else 4 if lead & 0xF8 == 0xF0 else 1
        if size <= back:
            return b""
        first = {0xE0: 0xA0, 0xF0: 0x90}.get(lead, 0x80)  # the smallest valid second byte
        rest = bytes([first]) + b"\x80" * (size - back - 1) if back == 1 else b"\x80" * (size - back)
        return rest
    return b""


_STRUCTURE = frozenset(b'",:]}')
_STRUCTURE_OR_ESCAPE = frozenset(b'"\\{}[],:')
_ENDS = (b'"', b",", b"}", b"]")
_NUMBER_OPEN = frozenset(b".eE+-")


def _repairs(old: bytes, data: bytes, forced: Callable[[], bytes]) -> Iterator[bytes]:
    """Closing paths to try after `data` instead of searching, likeliest first: the old
    path; the old path less the bytes `data` stood in for; the same after what finishes
    the lexeme `data` leaves open (a UTF-8 character, a digit after `.` `e` `-`, the bytes
    the grammar forces: the rest of an enum value); that finish and the old path after
    one of its first structural bytes (the old lexeme's own end)."""
    yield old
    skips = range(min(len(old), len(data) + 1), 0, -1)
    for skip in skips:
        yield old[skip:]
    finishes = []
    for finish in (_utf8_rest(data), b"0" if data[-1:] and data[-1] in _NUMBER_OPEN else b"", forced()):
        if finish and finish not in finishes:
            finishes.append(finish)
    boundaries = [index + 1 for index, byte in enumerate(old) if byte in _STRUCTURE][:3]
    for finish in finishes:
        for skip in (0, *skips, *(b for b in boundaries if b > len(data) + 1)):
            yield finish + old[skip:]


class Vocabulary:
    """The model's tokens as bytes, and closing bytes as tokens (llguidance's tokenizer)."""

    def __init__(self, tokenizer: Any, *, eos_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self._bytes = [bytes(tokenizer.decode_bytes([token])) for token in range(tokenizer.vocab_size)]
        self.eos = min(eos_ids) if eos_ids else None
        self.eos_ids = frozenset(eos_ids)
        self.longest = max((len(data) for data in self._bytes), default=1) or 1

    def bytes_of(self, token: int) -> bytes:
        return b"" if token in self.eos_ids or not 0 <= token < len(self._bytes) else self._bytes[token]

    def tokens(self, text: bytes) -> tuple[int, ...]:
        """Tokens that spell `text` exactly: longest match first, else the tokenizer's own."""
        if not text:
            return ()
        try:
            tokens = self._tokenizer.greedy_tokenize(text.decode())
        except UnicodeDecodeError:
            tokens = None
        if tokens is None:  # not UTF-8 (a character cut): the tokenizer's own
            tokens = self._tokenizer.tokenize_bytes(text)
        return tuple(int(token) for token in tokens)


class Plan:
    """A verified way to finish the value: its closing bytes `text`, as model tokens when
    asked (tokenized lazily: while the bytes alone show it fits, nobody asks); `exact` when
    it is the shortest the search finds (else a repair of an older plan: valid, maybe longer)."""

    __slots__ = ("_tokens", "_vocabulary", "exact", "text")

    def __init__(
        self,
        text: bytes,
        vocabulary: Vocabulary,
        *,
        tokens: tuple[int, ...] | None = None,
        exact: bool = True,
    ) -> None:
        self.text = text
        self.exact = exact
        self._vocabulary = vocabulary
        self._tokens = tokens

    @property
    def tokens(self) -> tuple[int, ...]:
        if self._tokens is None:
            self._tokens = self._vocabulary.tokens(self.text)
        return self._tokens

    @property
    def need(self) -> int:
        """Tokens it takes, its end-of-sequence token included."""
        return len(self.tokens) + 1

    def fits(self, room: int) -> bool:
        """Whether `need <= room`; a token holds at least a byte, so short text settles it."""
        return len(self.text) + 1 <= room or self.need <= room

    def after(self, data: bytes) -> Plan:
        """The rest once `data`, its first bytes, is generated (as exact as this plan)."""
        tokens = self._tokens
        rest = None
        if tokens and self._vocabulary.bytes_of(tokens[0]) == data:
            rest = tokens[1:]
        return Plan(self.text[len(data) :], self._vocabulary, tokens=rest, exact=self.exact)

    def next_token(self) -> int | None:
        """The token that starts it (the end of sequence when the value is complete)."""
        return self.tokens[0] if self.text else self._vocabulary.eos


class Budget:
    """The plan of one sequence and the decisions that keep it (see the module docstring).
    Not thread-safe: its `Constraint` calls it under the constraint's lock."""

    __slots__ = ("_approved", "_closer", "_vocabulary", "plan", "searches")

    def __init__(self, closer: Closer, vocabulary: Vocabulary) -> None:
        self._closer = closer
        self._vocabulary = vocabulary
        self._approved: tuple[int, Plan] | None = None  # the token approve() let through
        self.plan: Plan | None = None
        self.searches = 0  # fresh searches run (for the bench)

    def shortest(self) -> Plan | None:
        """The plan from here, searched now (at submit, and after a preemption)."""
        self.plan = self._search(None, limit=None)
        return self.plan

    def start(self, text: bytes | None) -> Plan | None:
        """The plan from the start, found before for the same grammar."""
        self.plan = None if text is None else Plan(text, self._vocabulary)
        return self.plan

    def feed(self, token: int) -> None:
        """`token` was generated (the matcher took it): move the plan along."""
        data = self._vocabulary.bytes_of(token)
        if not self._closer.feed(data):
            log.error(
                "the closing search's matcher rejected generated bytes %r: %s", data, self._closer.error
            )
            self.plan = None
            return
        approved, self._approved = self._approved, None
        if approved is not None and approved[0] == token:
            self.plan = approved[1]
        elif self.plan is not None:
            self.plan = self._advanced(self.plan, data)  # forced, or not approved here

    def rollback(self, tokens: Sequence[int]) -> None:
        """`tokens`, the last fed, were dropped (preemption): forget them and the plan."""
        self._closer.rollback(sum(len(self._vocabulary.bytes_of(token)) for token in tokens))
        self._approved = None
        self.plan = None

    def forced(self, remaining: int) -> int | None:
        """The token this step must take, when the plan has no slack left; else None."""
        plan = self.plan
        if plan is not None and not plan.exact and not plan.fits(remaining - 1 - _MARGIN):
            plan = self.plan = self._shorter(plan, None)
        if plan is None or plan.fits(remaining - 1):
            return None
        return plan.next_token()

    def approve(self, token: int, remaining: int) -> int:
        """`token` if the value can still finish after it within `remaining - 1` tokens,
        else the plan's next token (see the module docstring)."""
        plan = self.plan
        if plan is None or token in self._vocabulary.eos_ids:
            return token
        data = self._vocabulary.bytes_of(token)
        after = self._advanced(plan, data)
        if after is None:
            after = self._search(data, limit=remaining - 2)
        elif not after.exact and not after.fits(remaining - 1 - _MARGIN):
            after = self._shorter(after, data)
        if after is None or not after.fits(remaining - 1):
            fallback = plan.next_token()
            if fallback is None:  # a complete value and no end-of-sequence token to end it
                return token
            token = fallback
            after = plan.after(self._vocabulary.bytes_of(token))
        self._approved = (token, after)
        return token

    def _advanced(self, plan: Plan, data: bytes) -> Plan | None:
        """The plan after `data` without a search, when the old one tells it: its rest
        when `data` starts it (still the shortest), else the old closing bytes or a suffix
        of them that still closes after `data` (valid, maybe not the shortest: `data` often
        stands in for the bytes the suffix drops, like `",` for `"a` before an item), with
        the end of a UTF-8 character `data` leaves open before it."""
        if plan.text.startswith(data):
            return plan.after(data)
        old = plan.text
        text = self._closer.first_closing(data, lambda forced: _repairs(old, data, forced))
        if text is None:
            return None
        if text != old:
            return Plan(text, self._vocabulary, exact=False)
        # Content that only lengthens a string or number which could already end (the old
        # path starts by ending it) leaves the shortest path the shortest.
        extends = plan.exact and old[:1] in _ENDS and not _STRUCTURE_OR_ESCAPE.intersection(data)
        return Plan(text, self._vocabulary, tokens=plan._tokens, exact=extends)

    def _shorter(self, plan: Plan, data: bytes | None) -> Plan:
        """A searched plan when shorter than `plan` (a repair near the budget's end)."""
        found = self._search(data, limit=len(plan.tokens))
        return found if found is not None and found.need <= plan.need else plan

    def _search(self, data: bytes | None, *, limit: int | None) -> Plan | None:
        self.searches += 1
        bytes_limit = 1 << 16 if limit is None else max(0, limit) * self._vocabulary.longest
        if data is None:
            found = self._closer.closing(limit=bytes_limit)
        else:
            found = self._closer.closing_after(data, limit=bytes_limit)
        return None if found is None else Plan(found[0], self._vocabulary, exact=found[1])
