"""Numbers a double holds: JSON Schemas rewritten so that every number the grammar allows
is finite.

llguidance's grammar for an unbounded JSON number allows any exponent and any count of
digits, and a random-weight model writes `128.71482e327550309123232`, which parses to
infinity. With both a `minimum` and a `maximum`, llguidance compiles a number to digits
with no exponent, so the rewrite gives every number that lacks one the bound
±`NUMBER_LIMIT` (15 integer digits: every integer in it is exact in a double). It changes
nothing else a value may be: each keyword added only narrows numbers, and every place that
admits any JSON value (a `true` or empty schema, a missing `additionalProperties` or
`items`, OpenAI's `json_object`) gets `ANY`, the same "any value" with bounded numbers.
Fractional digits stay unbounded (a long fraction is still finite); the token budget ends
them (`_json_closing.py`).
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["ANY_NAME", "NUMBER_LIMIT", "bounded_object", "bounded_schema"]

NUMBER_LIMIT = 10**15 - 1
ANY_NAME = "loadmaster_bounded_any"
_ANY_REF = {"$ref": f"#/$defs/{ANY_NAME}"}
_ANY: dict[str, Any] = {
    "type": ["null", "boolean", "number", "string", "array", "object"],
    "minimum": -NUMBER_LIMIT,
    "maximum": NUMBER_LIMIT,
    "items": _ANY_REF,
    "additionalProperties": _ANY_REF,
}
_ANNOTATIONS = frozenset(
    ("title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "$id",
     "$schema", "$anchor")
)  # fmt: skip
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not", "if",
               "then", "else", "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def bounded_object() -> dict[str, Any]:
    """OpenAI's `json_object` (any object) with bounded numbers."""
    return {"type": "object", "additionalProperties": _ANY_REF, "$defs": {ANY_NAME: copy.deepcopy(_ANY)}}


def bounded_schema(schema: Any) -> Any:
    """A copy of `schema` whose numbers are all bounded (see the module docstring)."""
    root = _bounded(copy.deepcopy(schema))
    if not isinstance(root, dict):
        return root
    defs = root.get("$defs")
    if not isinstance(defs, dict):
        defs = root["$defs"] = {} if defs is None else defs
    if isinstance(defs, dict):
        defs.setdefault(ANY_NAME, copy.deepcopy(_ANY))
    return root


def _bounded(schema: Any) -> Any:
    if schema is True or (isinstance(schema, dict) and not (set(schema) - _ANNOTATIONS)):
        return dict(_ANY_REF)
    if not isinstance(schema, dict):
        return schema
    for key in _SCHEMA_MAPS:
        children = schema.get(key)
        if isinstance(children, dict):
            schema[key] = {name: _bounded(child) for name, child in children.items()}
    for key in _SCHEMA_ONE:
        if key in schema and (isinstance(schema[key], dict) or schema[key] is True):
            schema[key] = _bounded(schema[key])
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            schema[key] = [_bounded(child) for child in schema[key]]
    if isinstance(schema.get("items"), list):  # the old tuple form of prefixItems
        schema["items"] = [_bounded(child) for child in schema["items"]]
    if "$ref" in schema or "enum" in schema or "const" in schema:
        return schema  # its values are given (or bounded where the reference leads)
    kinds = schema.get("type")
    names = set(kinds) if isinstance(kinds, list) else {kinds}
    any_kind = kinds is None and not any(key in schema for key in _SCHEMA_LISTS[:3])
    if any_kind or names & {"number", "integer"}:
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            schema["maximum"] = NUMBER_LIMIT
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            schema["minimum"] = -NUMBER_LIMIT
    if any_kind or "object" in names:
        schema.setdefault("additionalProperties", dict(_ANY_REF))
    if any_kind or "array" in names:
        schema.setdefault("items", dict(_ANY_REF))
    return schema
