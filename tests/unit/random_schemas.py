"""Seeded random JSON Schemas for the structured-output tests and bench, and the length of
the shortest compact value each admits (worked out from the schema, not by any search).

Every schema is one llguidance can enforce and whose values are short: strings carry
`maxLength` (or an enum / a pattern), numbers bounds, arrays `maxItems`, nesting at most
three levels. It mixes objects (required and optional properties, `additionalProperties:
false`), arrays, `anyOf`, nullable type lists, enums, consts, patterns, integers and numbers.
Used by services/model-pool/tests/unit/test_structured_output.py and test_json_budget.py and
by bench/structured_output.py.
"""

from __future__ import annotations

import json
import random
from typing import Any

__all__ = ["PATTERNS", "random_schema", "random_schemas", "shortest_bytes"]

PATTERNS = {"^[a-z]{1,6}$": 1, "^[0-9]{3}-[0-9]{2}$": 6, "^(yes|no)$": 2}  # pattern: shortest match

_WORDS = ("id", "name", "tags", "score", "ok", "kind", "note", "items", "when", "owner", "size", "level")


def _leaf(rng: random.Random) -> dict[str, Any]:
    choice = rng.randrange(11)
    if choice == 0:
        return {"type": "string", "maxLength": rng.randint(0, 8)}
    if choice == 1:
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 5)}
    if choice == 2:
        return {
            "enum": rng.sample(
                ["red", "green", "blue", "open", "closed", 1, 2.5, None, True], rng.randint(1, 4)
            )
        }
    if choice == 3:
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if choice == 4:
        return {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25}
    if choice == 5:
        return {"type": "boolean"}
    if choice == 6:
        return {"type": "null"}
    if choice == 7:
        return {"const": rng.choice(["fixed", 7, False, None])}
    if choice == 8:
        return {"type": "string", "pattern": rng.choice(list(PATTERNS))}
    if choice == 9:
        return {"type": ["string", "null"], "maxLength": rng.randint(1, 6)}
    return {"type": "integer", "minimum": 0, "maximum": 9}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """One schema; `depth` is how deep in the tree this one sits (at most 3 levels)."""
    if depth >= 3 or rng.random() < 0.3 + 0.2 * depth:
        return _leaf(rng)
    kind = rng.randrange(4)
    if kind <= 1:
        names = rng.sample(_WORDS, rng.randint(1, 4))
        properties = {name: random_schema(rng, depth + 1) for name in names}
        required = [name for name in names if rng.random() < 0.7]
        return {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }
    if kind == 2:
        low = rng.randint(0, 2)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": low,
            "maxItems": low + rng.randint(0, 2),
        }
    return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}


def random_schemas(count: int, *, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def shortest_bytes(schema: dict[str, Any]) -> int:
    """Bytes of the shortest compact JSON value valid against a `random_schema` (llguidance
    writes properties in declaration order, required ones only when the rest are optional)."""
    if "anyOf" in schema:
        return min(shortest_bytes(option) for option in schema["anyOf"])
    if "enum" in schema:
        return min(len(_dumps(value)) for value in schema["enum"])
    if "const" in schema:
        return len(_dumps(schema["const"]))
    kind = schema.get("type")
    if kind == "string":
        return 2 + (PATTERNS[schema["pattern"]] if "pattern" in schema else schema.get("minLength", 0))
    if kind == ["string", "null"]:
        return 2
    if kind == "integer":
        low, high = schema["minimum"], schema["maximum"]
        return 1 if low <= 0 <= high else len(str(low if low > 0 else high))
    if kind == "number":
        return 1  # its range holds 0
    if kind in ("boolean", "null"):
        return 4
    if kind == "object":
        required = schema["required"]
        pairs = sum(len(_dumps(key)) + 1 + shortest_bytes(schema["properties"][key]) for key in required)
        return 2 + pairs + max(0, len(required) - 1)
    if kind == "array":
        count = schema["minItems"]
        return 2 + count * shortest_bytes(schema["items"]) + max(0, count - 1)
    raise ValueError(f"not a random_schema: {schema}")
