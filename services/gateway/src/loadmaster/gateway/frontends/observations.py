"""Robot observation dicts <-> one tensor call: the mapping the openpi and GR00T front ends share.

Both protocols send a (nested) dict of numpy arrays, strings and numbers and expect a dict of
arrays back. The rules (docs/robot-clients.md):
- nested keys are flattened with `/` ({"state": {"arm": a}} -> tensor "state/arm") and the
  outputs' names un-flattened on `/`;
- strings (and bytes) travel as BYTES tensors, numbers and lists as arrays of their numpy dtype,
  cast to the declared dtype of the model's input when numpy calls that a same-kind cast
  (float64 -> float32, int64 -> int32);
- when a declared input has one more dimension than the observation's value, a leading batch
  dimension of 1 is added, and then removed from every output that has one;
- anything else is checked where it always is: the gateway's limits here, the model's declared
  inputs on the worker (a key the model does not take is `invalid_argument` naming it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.gateway_config import LimitsSettings
from loadmaster.common.tensors import check_tensors, decode_tensors, encode_tensors, numpy_dtype
from loadmaster.gateway.calls import CallResult, InferenceCall
from loadmaster.gateway.validation import tensor_limits
from loadmaster.v1 import model_pool_pb2, tensor_pb2

__all__ = [
    "SEPARATOR",
    "CallOptions",
    "action_dict",
    "flatten",
    "observation_call",
    "parse_options",
    "unflatten",
]

SEPARATOR = "/"
_MAX_DEPTH = 8  # nesting of an observation dict
_PRIORITY_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class CallOptions:
    """What a robot front end may say about a call besides its tensors."""

    client_id: str
    client_type: str
    priority: int = 1
    urgency: float = 0.0
    timeout_ms: float = 0.0  # 0 = the scheduler's TTL
    connection_bound: bool = False


def parse_options(values: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """`priority`, `urgency` and `deadline_ms` from query parameters (strings) or GR00T options
    (msgpack values) -> CallOptions fields; anything else is refused, naming it."""
    fields: dict[str, Any] = {}
    for name, value in values.items():
        if name == "priority":
            fields["priority"] = _number(name, value, where, integer=True, low=0, high=_PRIORITY_MAX)
        elif name == "urgency":
            fields["urgency"] = _number(name, value, where, low=0.0, high=1.0)
        elif name == "deadline_ms":
            deadline = _number(name, value, where, low=0.0, high=3.6e6)
            if deadline <= 0:
                raise InvalidArgumentError(f"{where} 'deadline_ms' must be a positive number of milliseconds")
            fields["timeout_ms"] = deadline
        else:
            raise InvalidArgumentError(f"{where} '{name}' is not supported (priority, urgency, deadline_ms)")
    return fields


def _number(name: str, value: Any, where: str, *, integer: bool = False, low: float, high: float) -> Any:
    """A number from a query string or a msgpack value, in [low, high]."""
    kind = "an integer" if integer else "a number"
    number: float | None = None
    if not isinstance(value, bool | float | type(None)) or (not integer and isinstance(value, float)):
        try:
            number = int(value) if integer else float(value)
        except (TypeError, ValueError):
            number = None
    if number is None:
        raise InvalidArgumentError(f"{where} '{name}' must be {kind}, got {str(value)[:40]!r}")
    if not math.isfinite(number) or not low <= number <= high:
        raise InvalidArgumentError(
            f"{where} '{name}' must lie in [{low:g}, {high:g}], got {str(value)[:40]!r}"
        )
    return number


def flatten(tree: Mapping[Any, Any]) -> dict[str, Any]:
    """{"a": {"b": x}} -> {"a/b": x}; keys must be strings (bytes keys are decoded)."""
    flat: dict[str, Any] = {}
    for key, value in _walk(tree, "", 0):
        flat[key] = value
    return flat


def _walk(tree: Mapping[Any, Any], prefix: str, depth: int) -> Iterator[tuple[str, Any]]:
    if depth >= _MAX_DEPTH:
        raise InvalidArgumentError(f"observation '{prefix}': nested deeper than {_MAX_DEPTH} levels")
    for raw, value in tree.items():
        key = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"observation keys are non-empty strings, not {raw!r}"[:120])
        name = f"{prefix}{SEPARATOR}{key}" if prefix else key
        if isinstance(value, Mapping):
            yield from _walk(value, name, depth + 1)
        else:
            yield name, value


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"a/b": x} -> {"a": {"b": x}}; a name under a prefix that is itself a name ("a" and
    "a/b") stays whole ({"a": ..., "a/b": ...})."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        parts = name.split(SEPARATOR)
        prefixes = (SEPARATOR.join(parts[:end]) for end in range(1, len(parts)))
        if any(prefix in flat for prefix in prefixes):
            tree[name] = value
            continue
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def _array(name: str, value: Any) -> np.ndarray:
    """One observation value as an array: strings and bytes as object arrays (BYTES)."""
    if value is None:
        raise InvalidArgumentError(f"observation '{name}' is null")
    if isinstance(value, str | bytes):
        return np.array(value, dtype=object)
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as error:
        raise InvalidArgumentError(f"observation '{name}' is not an array: {error}"[:200]) from None
    kind = array.dtype.kind
    if kind in "US":
        return array.astype(object)
    if kind == "O":
        flat = array.reshape(-1).tolist()
        if not all(isinstance(item, str | bytes) for item in flat):
            raise InvalidArgumentError(f"observation '{name}' mixes strings with other values")
        return array
    if kind not in "biuf":
        raise InvalidArgumentError(f"observation '{name}': dtype {array.dtype} cannot be sent")
    return array


def observation_call(
    observation: Mapping[Any, Any],
    signature: model_pool_pb2.ModelSignature | None,
    *,
    model_id: str,
    request_id: str,
    options: CallOptions,
    limits: LimitsSettings,
) -> tuple[InferenceCall, bool]:
    """One call for `observation` (and whether a batch dimension was added to it)."""
    if not isinstance(observation, Mapping):
        raise InvalidArgumentError(f"an observation is a dict (map), not {type(observation).__name__}")
    flat = flatten(observation)
    if not flat:
        raise InvalidArgumentError("the observation is empty")
    if len(flat) > limits.max_tensors:
        raise InvalidArgumentError(f"{len(flat)} observation values exceed the limit of {limits.max_tensors}")
    declared = {spec.name: spec for spec in signature.inputs} if signature is not None else {}
    arrays: dict[str, np.ndarray] = {}
    batched = False
    for name, value in flat.items():
        array = _array(name, value)
        spec = declared.get(name)
        if spec is not None:
            if not spec.any_shape and len(spec.shape) == array.ndim + 1:
                array = array[np.newaxis]
                batched = True
            if spec.dtype != tensor_pb2.DTYPE_BYTES and array.dtype.kind != "O":
                target = numpy_dtype(spec.dtype)
                if array.dtype != target and np.can_cast(array.dtype, target, "same_kind"):
                    array = array.astype(target)
        arrays[name] = array
    descriptors, payload = encode_tensors(arrays)
    check_tensors(descriptors, payload, tensor_limits(limits))
    call = InferenceCall(
        request_id=request_id,
        client_id=options.client_id,
        client_type=options.client_type,
        connection_bound=options.connection_bound,
        model_id=model_id,
        inputs=descriptors,
        payload=payload,
        priority=options.priority,
        urgency=options.urgency,
        timeout_ms=options.timeout_ms,
        received_unix_ns=time.time_ns(),
        received_monotonic=time.monotonic(),
    )
    return call, batched


def action_dict(result: CallResult, *, unbatch: bool) -> dict[str, Any]:
    """The outputs of a call as a nested dict of arrays (strings for BYTES), the batch
    dimension of 1 removed when `unbatch`."""
    payload = result.payload
    buffer = payload.buffer if hasattr(payload, "buffer") else payload
    outputs = decode_tensors(result.outputs, buffer)
    flat: dict[str, Any] = {}
    for name, array in outputs.items():
        if unbatch and array.ndim and array.shape[0] == 1:
            array = array[0, ...]  # (a 0-d array, never a scalar)
        if array.dtype.kind == "O":  # BYTES: text where it is UTF-8
            flat[name] = _text(array)
        else:
            flat[name] = array
    return unflatten(flat)


def _text(array: np.ndarray) -> Any:
    def one(item: bytes) -> str | bytes:
        try:
            return item.decode()
        except UnicodeDecodeError:
            return item

    if array.ndim == 0:
        return one(array.item())
    return np.vectorize(one, otypes=[object])(array).tolist()
