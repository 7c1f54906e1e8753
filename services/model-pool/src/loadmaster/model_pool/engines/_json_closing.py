"""The shortest way to finish a JSON value from where its text stands, found with llguidance.

Structured output is generated within `max_tokens`; to promise a complete value, the engine
must know at every step how many tokens the shortest completion of the text so far takes.
llguidance answers "which bytes may come next", not "how far is the end", so `Closer`
searches for it. It keeps a second matcher over the same grammar with llguidance's byte
tokenizer (one token per byte: a step is one byte and a mask 256 bits, whatever the model's
vocabulary) and runs A* from the current state to an accepting one:

- cost: bytes; heuristic: `Shape.bound()` (`_json_shape.py`), a lower bound from the JSON
  Schema (required keys still missing with their shortest values, items below `minItems`,
  closers), so the first complete path popped is a shortest one;
- moves: the bytes the grammar forces (`compute_ff_bytes`: a required key, the rest of
  `true`) as one move; outside strings, `}` or `]` alone when allowed (closing the innermost
  container is never longer than adding to it), else every allowed byte of `_OUTSIDE`
  (continue with `,` `:`, or start a value); inside a string value, the closing quote alone
  when allowed, else its content bytes; inside a key, the closing quote (unless the key is
  already in the object: llguidance admits a repeated key, a JSON parser keeps only one of
  them) and content bytes (a required key may be longer than an optional one). Content bytes are all allowed ones
  when at most `_SMALL_SET` are (a pattern, an enum, a choice of keys), else one of each
  class (lowercase, digit, uppercase, non-ASCII) and every punctuation byte (`@` in an email),
  or a single letter in a free string; content children that leave the same next-byte mask
  and forced bytes are merged (one letter of a pattern's class is as good as another).

The path is valid by construction (llguidance accepted every byte). It is the shortest one
unless the search gives up (`_SEARCH_NODES`), or a value choice inside a string that the
moves leave out (an early closing quote in an `anyOf` of objects told apart by a string)
would have been shorter. The engine forces exactly the path it found, so what it promises
holds either way. `Closer.first_closing` re-checks earlier paths after a sampled token with
`validate_tokens` (tens of microseconds), which is what almost every step needs.
"""

from __future__ import annotations

import heapq
from typing import Any

import llguidance

from loadmaster.model_pool.engines._json_shape import SchemaIndex, Shape

__all__ = ["BYTE_TOKENIZER", "Closer"]

BYTE_TOKENIZER = llguidance.LLTokenizer("byte")  # token id = byte value (0..255)
_EOS = BYTE_TOKENIZER.eos_token
_QUOTE = ord('"')
_BACKSLASH = ord("\\")
_OUTSIDE = b',:0123456789"[{ntf-.eE+'  # after "}" and "]": continue, or start a value
_ESCAPES = b'nrtbf/\\"u'  # after a backslash: an escape that ends at once first
_SMALL_SET = 16  # a string's allowed content up to this many bytes is tried byte by byte
_ZERO = ord("0")
_SEARCH_NODES = 3000  # expansions per search before it gives up
_DIVE_BYTES = 512  # the depth-first fallback's longest path
_DIVE_NODES = 3000  # and its expansions


def _class(low: int, high: int) -> int:
    return sum(1 << byte for byte in range(low, high + 1))


_LOWER, _DIGIT, _UPPER = _class(0x61, 0x7A), _class(0x30, 0x39), _class(0x41, 0x5A)
_HIGH = _class(0x80, 0xFF)
_PRINTABLE = _class(0x20, 0x7E) & ~(1 << _QUOTE) & ~(1 << _BACKSLASH)
_PUNCTUATION = _PRINTABLE & ~(_LOWER | _DIGIT | _UPPER)
_CONTENT = _PRINTABLE | _HIGH


def _bits(matcher: Any) -> int:
    """The bytes the byte matcher allows next, as bits of an int (its EOS left out)."""
    return int.from_bytes(matcher.compute_bitmask()[:32], "little")


def _each(bits: int) -> list[int]:
    found = []
    while bits:
        low = bits & -bits
        found.append(low.bit_length() - 1)
        bits ^= low
    return found


def _lowest(bits: int) -> list[int]:
    return [(bits & -bits).bit_length() - 1] if bits else []


def _content_moves(bits: int) -> list[int]:
    """Content bytes standing for all allowed ones (see the module docstring)."""
    content = bits & _CONTENT
    if content.bit_count() <= _SMALL_SET:
        return _each(content)
    if content & _PRINTABLE == _PRINTABLE:  # a free string: any character is as good
        return _lowest(content & _LOWER) or _lowest(content)
    chosen = [*_lowest(content & _LOWER), *_lowest(content & _DIGIT), *_lowest(content & _UPPER)]
    return [*chosen, *_lowest(content & _HIGH), *_each(content & _PUNCTUATION)]


def _moves(matcher: Any, shape: Shape) -> tuple[list[bytes], bool]:
    """The moves worth trying from a state (see the module docstring), and whether they
    stand for more (children with the same mask may then be merged)."""
    forced = matcher.compute_ff_bytes()
    if forced:
        return [bytes(forced)], False
    bits = _bits(matcher)
    if shape.escaped:
        return [bytes([byte]) for byte in _ESCAPES if bits >> byte & 1][:1] or [bytes(_lowest(bits))], False
    if shape.in_string:
        moves = []
        if bits >> _QUOTE & 1:
            if not shape.in_key:
                return [b'"'], False
            if not shape.key_seen():  # llguidance takes a repeated key; JSON parsers keep one
                moves.append(b'"')
        chosen = _content_moves(bits)
        return moves + [bytes([byte]) for byte in chosen] or [bytes(_lowest(bits))], len(chosen) > 1
    for closer in b"}]":
        if bits >> closer & 1:
            return [bytes([closer])], False
    if shape.at_value and bits >> _ZERO & 1 and _zero_ends(matcher):
        return [b"0"], False  # the shortest value there is
    moves = [bytes([byte]) for byte in _OUTSIDE if bits >> byte & 1]
    return moves or [bytes(_lowest(bits))], False


def _signature(matcher: Any) -> bytes:
    """What a state allows next: its byte mask and forced bytes (children alike merge)."""
    return bytes(matcher.compute_bitmask()) + bytes(matcher.compute_ff_bytes())


def _zero_ends(matcher: Any) -> bool:
    """Whether a value may be just `0` here (then no other value can be shorter)."""
    return any(matcher.validate_tokens([_ZERO, after]) == 2 for after in (*b",}]", _EOS))


class Closer:
    """A byte-level twin of one sequence's matcher: `feed` it the bytes the sequence
    generates; `closing` (from here) and `closing_after` (from here plus a sampled token)
    search the shortest completion, `first_closing` re-checks given ones. Not thread-safe:
    its `Constraint` holds the lock."""

    __slots__ = ("_index", "_matcher", "_shape_at", "_shaped", "_text")

    def __init__(self, grammar: str, schema: Any, index: SchemaIndex | None = None) -> None:
        self._matcher = llguidance.LLMatcher(BYTE_TOKENIZER, grammar, log_level=0)
        self._index = index or SchemaIndex(schema)
        self._shaped = Shape(self._index)  # the shape of `_text[:_shape_at]`
        self._shape_at = 0
        self._text = bytearray()  # everything fed (the shape follows only when a search asks)

    @property
    def _shape(self) -> Shape:
        if self._shape_at < len(self._text):
            self._shaped.feed(bytes(self._text[self._shape_at :]))
            self._shape_at = len(self._text)
        return self._shaped

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def feed(self, data: bytes) -> bool:
        """Advance by generated bytes; False if the grammar rejects them."""
        if not data:
            return True
        if not self._matcher.consume_tokens(list(data)):
            return False
        self._text += data
        return True

    def rollback(self, count: int) -> None:
        """Undo the last `count` bytes fed (a token dropped at preemption)."""
        if count <= 0:
            return
        self._matcher.rollback(count)
        del self._text[-count:]
        self._shaped = Shape(self._index)
        self._shape_at = 0

    def closing(self, *, limit: int) -> tuple[bytes, bool] | None:
        """The bytes of a path from here to a complete value (b"" when complete) and
        whether it is a shortest one, or None when none of at most `limit` bytes is found:
        A* first; when it gives up, a depth-first dive along the preferred moves (valid,
        maybe longer: a date-time format, where the bound cannot see how far the end is)."""
        return self._closing(self._matcher, self._shape, limit)

    def closing_after(self, data: bytes, *, limit: int) -> tuple[bytes, bool] | None:
        """`closing` from here plus `data`; None also when the grammar rejects `data`."""
        matcher = self._matcher
        taken = matcher.try_consume_tokens(list(data))
        try:
            if taken != len(data):
                return None
            shape = self._shape.copy()
            shape.feed(data)
            return self._closing(matcher, shape, limit)
        finally:
            matcher.rollback(taken)

    @classmethod
    def _closing(cls, matcher: Any, shape: Shape, limit: int) -> tuple[bytes, bool] | None:
        found = cls._search(matcher, shape, limit, dive=False, nodes=_SEARCH_NODES)
        if found is not None:
            return found, True
        found = cls._search(matcher, shape, min(limit, _DIVE_BYTES), dive=True, nodes=_DIVE_NODES)
        return None if found is None else (found, False)

    def first_closing(self, data: bytes, candidates: Any) -> bytes | None:
        """The first of `candidates(forced)` that completes the value after `data` (the
        cheap re-check), where `forced()` gives the bytes the grammar forces after `data`;
        None when none does or the grammar rejects `data`."""
        matcher = self._matcher
        taken = matcher.try_consume_tokens(list(data))
        try:
            if taken != len(data):
                return None
            for path in candidates(lambda: bytes(matcher.compute_ff_bytes())):
                tokens = [*path, _EOS]
                if matcher.validate_tokens(tokens) == len(tokens):
                    return bytes(path)
            return None
        finally:
            matcher.rollback(taken)

    @staticmethod
    def _search(matcher: Any, shape: Shape, limit: int, *, dive: bool, nodes: int) -> bytes | None:
        """A* (see the module docstring), or with `dive` depth first (the deepest node,
        then the first move), on the live matcher: a node is its path from here, reached by
        rolling back to the common prefix and consuming the rest (a deep copy would start
        with cold lexer caches: 20-100x slower per byte)."""
        if matcher.is_accepting():
            return b""
        heap: list[tuple[int, int, int, bytes, Shape]] = [(0 if dive else shape.bound(), 0, 0, b"", shape)]
        # A* ranks by cost + bound (ties: the deeper, then the preferred move); the dive by
        # depth, then moves that change the state (`@` in an email) before ones that leave
        # it as it was (another letter).
        at = b""  # the path the matcher stands at
        pushed = expanded = 0
        try:
            while heap:
                _, _, _, path, node_shape = heapq.heappop(heap)
                at = _move_to(matcher, at, path)
                if matcher.is_accepting():
                    return path
                expanded += 1
                if expanded > nodes:
                    return None
                moves, merge = _moves(matcher, node_shape)
                here = _signature(matcher) if merge and dive else b""
                seen: set[bytes] = set()
                for move in moves:
                    grown = path + move
                    if len(grown) > limit or matcher.validate_tokens(list(move)) != len(move):
                        continue
                    same = 0
                    if merge:  # content bytes that lead on alike (same mask, forced bytes): one
                        matcher.consume_tokens(list(move))
                        signature = _signature(matcher)
                        matcher.rollback(len(move))
                        if signature in seen:
                            continue
                        seen.add(signature)
                        same = int(signature == here)  # the dive tries what moves on first
                    child_shape = node_shape.copy()
                    child_shape.feed(move)
                    pushed += 1
                    cost = len(grown)
                    rank, tie = (-cost, same) if dive else (cost + child_shape.bound(), -cost)
                    heapq.heappush(heap, (rank, tie, pushed, grown, child_shape))
            return None
        finally:
            _move_to(matcher, at, b"")


def _move_to(matcher: Any, at: bytes, path: bytes) -> bytes:
    """Bring `matcher` from `at` to `path` (both paths from the same state)."""
    common = 0
    for left, right in zip(at, path, strict=False):
        if left != right:
            break
        common += 1
    if len(at) > common:
        matcher.rollback(len(at) - common)
    if len(path) > common:
        matcher.consume_tokens(list(path[common:]))
    return path
