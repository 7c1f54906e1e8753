"""Where compact JSON text stands, and a lower bound on the bytes that finish it.

`Shape` follows JSON text byte by byte (which containers are open, which keys each object
has, whether the text is inside a string) and, given the JSON Schema the text is generated
against (`SchemaIndex`), gives a lower bound on the bytes any valid completion still needs:
the required keys an object lacks with the shortest values their schemas allow, the items
an array lacks below `minItems`, the closers. The closing search (`_json_closing.py`) uses
it as the admissible heuristic of an A* search over llguidance's matcher, so the search
walks straight to the shortest completion instead of trying every optional key.

The bound only guides; llguidance decides what is valid. Where the schema is ambiguous
(`anyOf`, `allOf`, a key that could be several properties) the bound takes the smallest
alternative, and where it cannot tell it assumes any value (1 byte), so it stays a lower
bound; a schema feature it does not model makes the search slower, never wrong.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

__all__ = ["SchemaIndex", "Shape"]

_ANY: dict[str, Any] = {}  # "any JSON value" (a `true` schema, or one this module cannot follow)
_QUOTE = ord('"')
_BACKSLASH = ord("\\")
_SCALAR_ENDS = frozenset(b",}]")
_TYPE_MIN = {"string": 2, "number": 1, "integer": 1, "boolean": 4, "null": 4, "object": 2, "array": 2}


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class SchemaIndex:
    """A JSON Schema, resolved for lower bounds: alternatives (`$ref`, `anyOf`, `oneOf`,
    `allOf` flattened), children of objects and arrays, and each part's shortest
    compact serialization (memoized; a recursive `$ref` counts 0 while in progress)."""

    def __init__(self, root: Any) -> None:
        self._root = root
        self._min: dict[int, int] = {}
        self._resolved: dict[int, tuple[dict[str, Any], ...]] = {}
        self._children: dict[tuple[int, str, Any], tuple[dict[str, Any], ...]] = {}
        self._missing: dict[tuple[int, int, bool], int] = {}
        self._keep: list[Any] = []  # objects whose ids key the memos stay alive

    def root(self) -> tuple[dict[str, Any], ...]:
        return self.resolve(self._root)

    def resolve(self, schema: Any, depth: int = 0) -> tuple[dict[str, Any], ...]:
        """The concrete alternatives a value of `schema` satisfies one of (lower-bound
        sense: each is at most as strict as `schema`)."""
        if schema is True or schema is None:
            return (_ANY,)
        if schema is False:
            return ()
        if not isinstance(schema, dict):
            return (_ANY,)
        cached = self._resolved.get(id(schema))
        if cached is not None:
            return cached
        if depth > 32:
            return (_ANY,)
        alternatives: list[dict[str, Any]] = []
        if "$ref" in schema:
            alternatives.extend(self.resolve(self._deref(schema["$ref"]), depth + 1))
        for keyword in ("anyOf", "oneOf", "allOf"):
            for sub in schema.get(keyword) or ():
                alternatives.extend(self.resolve(sub, depth + 1))
        combinators = ("$ref", "anyOf", "oneOf", "allOf")
        own = [key for key in schema if key not in combinators and not key.startswith("$")]
        if own or not alternatives:
            alternatives.append(schema)
        result = tuple(alternatives)
        self._resolved[id(schema)] = result
        self._keep.append(schema)
        return result

    def _deref(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            return True
        node: Any = self._root
        for part in ref[1:].split("/")[1:]:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return True
        return node

    def min_len(self, schemas: tuple[dict[str, Any], ...]) -> int:
        """The fewest bytes of a compact value valid against one of `schemas`."""
        return min((self._min_concrete(schema) for schema in schemas), default=1)

    def _min_concrete(self, schema: dict[str, Any]) -> int:
        key = id(schema)
        cached = self._min.get(key)
        if cached is not None:
            return cached
        self._min[key] = 0  # a recursive reference to itself counts 0 meanwhile
        self._keep.append(schema)
        result = self._compute_min(schema)
        self._min[key] = result
        return result

    def _compute_min(self, schema: dict[str, Any]) -> int:
        if schema is _ANY:
            return 1
        if "const" in schema:
            return len(_dumps(schema["const"]).encode())
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return min(len(_dumps(value).encode()) for value in schema["enum"])
        kinds = schema.get("type")
        if kinds is None:
            return 1
        best = None
        for kind in kinds if isinstance(kinds, list) else [kinds]:
            if kind == "string":
                size = 2 + _string_min(schema)
            elif kind in ("number", "integer"):
                size = _number_min(schema, integer=kind == "integer")
            elif kind == "object":
                missing = self.missing_keys((schema,), frozenset())
                size = 2 + missing[0] + max(0, missing[1] - 1)
            elif kind == "array":
                size = 1 + self.missing_items((schema,), 0, first=True)
            else:
                size = _TYPE_MIN.get(kind, 1)
            best = size if best is None else min(best, size)
        return 1 if best is None else best

    def _memo(self, schemas: tuple[dict[str, Any], ...], kind: str, arg: Any, make: Any) -> Any:
        key = (id(schemas), kind, arg)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = make()
            self._keep.append(schemas)
        return found

    def objects(self, schemas: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        """The alternatives that admit an object."""
        return self._memo(
            schemas, "object", None, lambda: tuple(s for s in schemas if _admits(s, "object")) or (_ANY,)
        )

    def arrays(self, schemas: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        return self._memo(
            schemas, "array", None, lambda: tuple(s for s in schemas if _admits(s, "array")) or (_ANY,)
        )

    def property(self, objects: tuple[dict[str, Any], ...], key: str) -> tuple[dict[str, Any], ...]:
        """The alternatives of the value under `key` in an object valid against `objects`."""
        return self._memo(objects, "property", key, lambda: self._property(objects, key))

    def _property(self, objects: tuple[dict[str, Any], ...], key: str) -> tuple[dict[str, Any], ...]:
        found: list[dict[str, Any]] = []
        for schema in objects:
            properties = schema.get("properties") or {}
            if isinstance(properties, dict) and key in properties:
                found.extend(self.resolve(properties[key]))
                continue
            matched = False
            for pattern, sub in (schema.get("patternProperties") or {}).items():
                try:
                    hit = re.search(pattern, key) is not None
                except re.error:
                    hit = True  # cannot tell: count it
                if hit:
                    matched = True
                    found.extend(self.resolve(sub))
            if not matched:
                extra = schema.get("additionalProperties", True)
                found.extend(self.resolve(extra) if extra is not False else ())
        return tuple(found) or (_ANY,)

    def item(self, arrays: tuple[dict[str, Any], ...], index: int) -> tuple[dict[str, Any], ...]:
        """The alternatives of item `index` of an array valid against `arrays`."""
        prefixed = any(isinstance(schema.get("prefixItems"), list) for schema in arrays)
        return self._memo(arrays, "item", index if prefixed else -1, lambda: self._item(arrays, index))

    def _item(self, arrays: tuple[dict[str, Any], ...], index: int) -> tuple[dict[str, Any], ...]:
        found: list[dict[str, Any]] = []
        for schema in arrays:
            prefix = schema.get("prefixItems")
            if isinstance(prefix, list) and index < len(prefix):
                found.extend(self.resolve(prefix[index]))
            else:
                items = schema.get("items", True)
                found.extend(self.resolve(items if not isinstance(items, list) else True))
        return tuple(found) or (_ANY,)

    def missing_keys(
        self, objects: tuple[dict[str, Any], ...], seen: frozenset[str], pairs: int = 0
    ) -> tuple[int, int]:
        """(bytes, count) of the cheapest alternative's required pairs not in `seen`, and
        the pairs `minProperties` still asks for beyond them and the `pairs` written:
        `"key":value` each, commas not counted."""
        best: tuple[int, int] | None = None
        for schema in objects:
            required = schema.get("required") or ()
            size = count = 0
            for key in required:
                if not isinstance(key, str) or key in seen:
                    continue
                count += 1
                size += len(_dumps(key).encode()) + 1 + self.min_len(self.property((schema,), key))
            extra = _int(schema.get("minProperties")) - pairs - count  # pairs beyond `required`
            if extra > 0:
                size, count = size + 4 * extra, count + extra  # '"":0' at least each
            if best is None or size < best[0]:
                best = (size, count)
        return best or (0, 0)

    def missing_items(self, arrays: tuple[dict[str, Any], ...], done: int, *, first: bool) -> int:
        """Bytes of the cheapest alternative's items still below `minItems` after `done`
        items, with their commas (none before the first when `first`), and the `]`."""
        key = (id(arrays), done, first)
        cached = self._missing.get(key)
        if cached is None:
            cached = self._missing[key] = self._missing_items(arrays, done, first=first)
            self._keep.append(arrays)
        return cached

    def _missing_items(self, arrays: tuple[dict[str, Any], ...], done: int, *, first: bool) -> int:
        best: int | None = None
        for schema in arrays:
            wanted = _int(schema.get("minItems"))
            size = 1
            for index in range(done, max(done, wanted)):
                size += self.min_len(self.item((schema,), index)) + (0 if first and index == done else 1)
            best = size if best is None else min(best, size)
        return 1 if best is None else best

    @staticmethod
    def rest_of_string(schemas: tuple[dict[str, Any], ...], text: bytes, chars: int) -> int:
        """The fewest content bytes a string value begun with `text` (`chars` characters)
        still needs before its closing quote, over the alternatives it can still be."""
        best: int | None = None
        for schema in schemas:
            values = _literals(schema)
            if values is not None:
                for value in values:
                    if isinstance(value, str):
                        encoded = _dumps(value).encode()[1:-1]
                        if encoded.startswith(text):
                            best = _least(best, len(encoded) - len(text))
            elif _admits(schema, "string"):
                best = _least(best, max(0, _string_min(schema) - chars))
        return best or 0

    @staticmethod
    def rest_of_scalar(schemas: tuple[dict[str, Any], ...], text: bytes) -> int:
        """The fewest bytes a number or literal begun with `text` still needs."""
        best: int | None = None
        for schema in schemas:
            values = _literals(schema)
            if values is not None:
                for value in values:
                    encoded = _dumps(value).encode()
                    if not isinstance(value, str) and encoded.startswith(text):
                        best = _least(best, len(encoded) - len(text))
                continue
            for literal, kind in ((b"true", "boolean"), (b"false", "boolean"), (b"null", "null")):
                if literal.startswith(text) and _admits(schema, kind):
                    best = _least(best, len(literal) - len(text))
            for kind in ("integer", "number"):
                if _admits(schema, kind) and text[:1] in b"-0123456789":
                    best = _least(best, max(0, _number_min(schema, integer=kind == "integer") - len(text)))
        return best or 0


def _least(best: int | None, size: int) -> int:
    return size if best is None else min(best, size)


def _literals(schema: dict[str, Any]) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    values = schema.get("enum")
    return values if isinstance(values, list) else None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _string_min(schema: dict[str, Any]) -> int:
    """Characters a string valid against `schema` has at least (`minLength`, `pattern`)."""
    least = _int(schema.get("minLength"))
    pattern = schema.get("pattern")
    return max(least, _pattern_min(pattern)) if isinstance(pattern, str) else least


@functools.lru_cache(maxsize=1024)
def _pattern_min(pattern: str) -> int:
    """The shortest match of a pattern (the private parser is a hint, not a need)."""
    try:
        return int(re._parser.parse(pattern).getwidth()[0])  # type: ignore[attr-defined]
    except Exception:
        return 0


def _number_min(schema: dict[str, Any], *, integer: bool) -> int:
    """Bytes of the shortest number in `schema`'s range (a lower bound)."""
    low = _bound(schema, "minimum", "exclusiveMinimum", 1)
    high = _bound(schema, "maximum", "exclusiveMaximum", -1)
    if (low is None or low <= 0) and (high is None or high >= 0):
        return 1
    if low is not None and low > 0:
        whole = math.ceil(low)
        fits = high is None or whole <= high
        return len(str(whole)) if fits else (1 if integer else 3)
    assert high is not None
    whole = math.floor(high)
    fits = low is None or whole >= low
    return len(str(whole)) if fits else (2 if integer else 4)


def _bound(schema: dict[str, Any], inclusive: str, exclusive: str, step: int) -> float | None:
    value = schema.get(inclusive)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    value = schema.get(exclusive)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value) + step * 1e-9  # past the excluded end (a lower bound on size)
    return None


def _admits(schema: dict[str, Any], kind: str) -> bool:
    kinds = schema.get("type")
    if kinds is None:
        return "enum" not in schema and "const" not in schema
    return kind in kinds if isinstance(kinds, list) else kind == kinds


# Modes: where the next byte goes.
_VALUE = 0  # a value starts here
_STRING = 1  # inside a string value
_SCALAR = 2  # inside a number or true/false/null
_AFTER = 3  # after a value: "," or a closer (or the end)
_KEYSTART = 4  # in an object, where a key (or "}" right after "{") comes
_KEY = 5  # inside a key
_COLON = 6  # after a key
_ARRAYSTART = 7  # right after "["
_END = 8


@dataclass(slots=True)
class _Frame:
    is_object: bool
    schemas: tuple[dict[str, Any], ...]
    seen: frozenset[str] = frozenset()
    key: str | None = None  # the key whose value is being written
    count: int = 0  # items (arrays) or pairs (objects) finished
    after_comma: bool = False

    def copy(self) -> _Frame:
        return _Frame(self.is_object, self.schemas, self.seen, self.key, self.count, self.after_comma)


@dataclass(slots=True)
class Shape:
    """The position in compact JSON text (see the module docstring). `feed` bytes,
    `bound()` the least bytes still needed; `copy` is cheap (frames are small)."""

    index: SchemaIndex
    mode: int = _VALUE
    frames: list[_Frame] = field(default_factory=list)
    value: tuple[dict[str, Any], ...] = ()  # alternatives of the value at _VALUE/_STRING
    chars: int = 0  # characters of the string being written
    escaped: bool = False
    text: bytearray = field(default_factory=bytearray)  # the string, key or scalar so far

    def __post_init__(self) -> None:
        if not self.value and self.mode == _VALUE and not self.frames:
            self.value = self.index.root()

    @property
    def in_string(self) -> bool:
        return self.mode in (_STRING, _KEY)

    @property
    def in_key(self) -> bool:
        return self.mode == _KEY

    def key_seen(self) -> bool:
        """Whether the key being written, closed now, would repeat one of its object's."""
        if self.mode != _KEY or not self.frames:
            return False
        try:
            key = json.loads(b'"' + bytes(self.text) + b'"')
        except ValueError:
            return False
        return key in self.frames[-1].seen

    @property
    def at_value(self) -> bool:
        """Where a value starts (after ":", "[" or "," in an array, or at the top)."""
        return self.mode in (_VALUE, _ARRAYSTART)

    def copy(self) -> Shape:
        return Shape(
            self.index,
            self.mode,
            [frame.copy() for frame in self.frames],
            self.value,
            self.chars,
            self.escaped,
            bytearray(self.text),
        )

    def feed(self, data: bytes) -> None:
        for byte in data:
            self._byte(byte)

    def _byte(self, byte: int) -> None:
        mode = self.mode
        if mode in (_STRING, _KEY):
            if self.escaped:
                self.escaped = False
            elif byte == _BACKSLASH:
                self.escaped = True
                self.chars += 1
                self.text.append(byte)
                return
            elif byte == _QUOTE:
                if mode == _STRING:
                    self._value_done()
                else:
                    self._key_done()
                return
            if byte & 0xC0 != 0x80:  # a character starts (UTF-8 continuation bytes do not)
                self.chars += 1
            self.text.append(byte)
            return
        if mode == _SCALAR:
            if byte not in _SCALAR_ENDS:
                self.text.append(byte)
                return
            self._value_done()
            mode = self.mode
        if mode == _ARRAYSTART:
            if byte == ord("]"):
                self._close()
                return
            self._start_item()
            mode = self.mode
        if mode == _VALUE:
            if byte == ord("{"):
                self.frames.append(_Frame(True, self.index.objects(self.value)))
                self.mode = _KEYSTART
            elif byte == ord("["):
                self.frames.append(_Frame(False, self.index.arrays(self.value)))
                self.mode = _ARRAYSTART
            elif byte == _QUOTE:
                self.mode, self.chars = _STRING, 0
                self.text.clear()
            else:
                self.mode = _SCALAR
                self.text[:] = bytes([byte])
        elif mode == _AFTER:
            if byte == ord(","):
                frame = self.frames[-1]
                frame.after_comma = True
                if frame.is_object:
                    self.mode = _KEYSTART
                else:
                    self._start_item()
            elif byte in _SCALAR_ENDS:
                self._close()
        elif mode == _KEYSTART:
            if byte == _QUOTE:
                self.mode, self.chars = _KEY, 0
                self.text.clear()
            elif byte == ord("}"):
                self._close()
        elif mode == _COLON and byte == ord(":"):
            frame = self.frames[-1]
            self.value = self.index.property(frame.schemas, frame.key or "")
            self.mode = _VALUE

    def _start_item(self) -> None:
        frame = self.frames[-1]
        self.value = self.index.item(frame.schemas, frame.count)
        self.mode = _VALUE

    def _key_done(self) -> None:
        try:
            key = json.loads(b'"' + bytes(self.text) + b'"')
        except ValueError:
            key = self.text.decode("utf-8", "replace")
        self.frames[-1].key = key
        self.mode = _COLON

    def _value_done(self) -> None:
        if not self.frames:
            self.mode = _END
            return
        frame = self.frames[-1]
        frame.count += 1
        if frame.is_object and frame.key is not None:
            frame.seen = frame.seen | {frame.key}
            frame.key = None
        frame.after_comma = False
        self.mode = _AFTER

    def _close(self) -> None:
        self.frames.pop()
        self._value_done()

    def bound(self) -> int:
        """Bytes any valid completion still needs, at least."""
        index = self.index
        mode = self.mode
        total = 0
        if mode == _VALUE:
            total += index.min_len(self.value)
        elif mode == _STRING:
            total += 1 + index.rest_of_string(self.value, bytes(self.text), self.chars)
        elif mode == _SCALAR:
            total += index.rest_of_scalar(self.value, bytes(self.text))
        elif mode == _KEY:
            total += 3  # the closing quote, ":" and a value
        elif mode == _COLON:
            frame = self.frames[-1]
            total += 1 + index.min_len(index.property(frame.schemas, frame.key or ""))
        for depth, frame in enumerate(reversed(self.frames)):
            top = depth == 0
            if frame.is_object:
                pending = frame.key
                seen = frame.seen | {pending} if pending is not None else frame.seen
                pairs = frame.count + (pending is not None or (top and mode == _KEY))
                size, count = index.missing_keys(frame.schemas, seen, pairs)
                if top and mode == _KEY and count:
                    size, count = max(0, size - self._dearest(frame, seen)), count - 1
                elif top and mode == _KEYSTART:
                    if count:
                        count -= 1  # the first missing pair takes no comma
                    elif frame.after_comma:
                        size += 4  # a comma promises one more pair: '"":0' at least
                total += size + count + 1
            else:
                done = frame.count + (0 if top and mode in (_ARRAYSTART, _AFTER) else 1)
                total += index.missing_items(frame.schemas, done, first=top and mode == _ARRAYSTART)
        return total

    def _dearest(self, frame: _Frame, seen: frozenset[str]) -> int:
        """The costliest missing required pair (the key being written may be it)."""
        index = self.index
        worst = 0
        for schema in frame.schemas:
            for key in schema.get("required") or ():
                if isinstance(key, str) and key not in seen:
                    size = len(_dumps(key).encode()) + 1 + index.min_len(index.property((schema,), key))
                    worst = max(worst, size)
        return worst
