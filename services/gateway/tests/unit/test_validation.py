from __future__ import annotations

import numpy as np
import pytest

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.gateway_config import LimitsSettings
from loadmaster.common.tensors import encode_tensors, shape_elements_at_most
from loadmaster.gateway.validation import (
    INLINE_BYTES_ELEMENTS,
    bytes_elements,
    observation_to_call,
    parse_observation,
)
from loadmaster.v1 import edge_pb2, tensor_pb2

LIMITS = LimitsSettings()


def _observation(**tensors: np.ndarray) -> tuple[edge_pb2.Observation, bytes]:
    descriptors, payload = encode_tensors(tensors)
    observation = edge_pb2.Observation(model_id="double", tensors=descriptors, priority=2, urgency=0.5)
    observation.client.id = "robot-1"
    return observation, bytes(payload)


def test_a_valid_observation_becomes_a_call_without_copying_the_payload() -> None:
    observation, payload = _observation(x=np.arange(4, dtype=np.float32))
    observation.metadata["timeout_ms"] = "25"
    observation.steps_remaining = 3
    call = observation_to_call(observation, payload, request_id="r1", limits=LIMITS)
    assert (call.model_id, call.client_id, call.priority, call.urgency) == ("double", "robot-1", 2, 0.5)
    assert call.timeout_ms == 25.0
    assert call.steps_remaining == 3
    assert call.payload is payload


def test_steps_remaining_absent_stays_none() -> None:
    observation, payload = _observation(x=np.zeros(1, dtype=np.float32))
    assert observation_to_call(observation, payload, request_id="r", limits=LIMITS).steps_remaining is None


def test_garbage_envelope_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="not an Observation"):
        parse_observation(b"\xff\xff\xff\xff", LIMITS)


def test_missing_model_id_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="model_id"):
        parse_observation(edge_pb2.Observation().SerializeToString(), LIMITS)


def test_oversized_envelope_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="envelope"):
        parse_observation(b"x" * 100, LimitsSettings(max_envelope_bytes=10))


@pytest.mark.parametrize("value", ["abc", "-5", "0", "nan", "inf"])
def test_bad_timeout_metadata_names_the_field(value: str) -> None:
    observation, payload = _observation(x=np.zeros(1, dtype=np.float32))
    observation.metadata["timeout_ms"] = value
    with pytest.raises(InvalidArgumentError, match="timeout_ms"):
        observation_to_call(observation, payload, request_id="r", limits=LIMITS)


def test_tensor_that_does_not_match_the_payload_names_the_tensor() -> None:
    observation = edge_pb2.Observation(model_id="double")
    observation.tensors.append(
        tensor_pb2.Tensor(
            key="state", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[8], byte_offset=0, byte_length=32
        )
    )
    with pytest.raises(InvalidArgumentError, match="'state'"):
        observation_to_call(observation, b"\x00" * 16, request_id="r", limits=LIMITS)


def test_metadata_over_the_limit_is_refused() -> None:
    observation, payload = _observation(x=np.zeros(1, dtype=np.float32))
    observation.metadata["blob"] = "y" * 100
    with pytest.raises(InvalidArgumentError, match="metadata"):
        observation_to_call(
            observation, payload, request_id="r", limits=LimitsSettings(max_metadata_bytes=50)
        )


def test_urgency_is_clamped_into_zero_to_one() -> None:
    observation, payload = _observation(x=np.zeros(1, dtype=np.float32))
    observation.urgency = 7.0
    assert observation_to_call(observation, payload, request_id="r", limits=LIMITS).urgency == 1.0


class _WatchedPayload:
    """A payload that notes which thread reads it (the check reads `.buffer`, as of a zmq.Frame)."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.read_on: list[str] = []

    @property
    def buffer(self) -> bytes:
        import threading

        self.read_on.append(threading.current_thread().name)
        return self._data


async def test_observations_with_many_bytes_elements_are_checked_off_the_event_loop() -> None:
    from loadmaster.gateway.validation import (
        INLINE_BYTES_ELEMENTS,
        needs_off_loop,
        observation_to_call_off_loop,
    )

    small, small_data = _observation(s=np.array([b"ab"] * INLINE_BYTES_ELEMENTS, dtype=object))
    large, large_data = _observation(s=np.array([b"ab"] * (INLINE_BYTES_ELEMENTS + 1), dtype=object))
    assert not needs_off_loop(small) and needs_off_loop(large)
    inline, threaded = _WatchedPayload(small_data), _WatchedPayload(large_data)
    call = await observation_to_call_off_loop(small, inline, request_id="r1", limits=LIMITS)
    assert call.payload is inline and set(inline.read_on) == {"MainThread"}
    call = await observation_to_call_off_loop(large, threaded, request_id="r2", limits=LIMITS)
    assert call.payload is threaded and all(
        name.startswith("gateway-validation") for name in threaded.read_on
    )
    broken = edge_pb2.Observation()
    broken.CopyFrom(large)
    broken.tensors[0].shape[0] += 1
    with pytest.raises(InvalidArgumentError, match="tensor 's'"):
        await observation_to_call_off_loop(
            broken, _WatchedPayload(large_data), request_id="r3", limits=LIMITS
        )


def test_counting_a_shape_stops_at_the_cap_whatever_its_length() -> None:
    """A client's shape is counted on the event loop: a huge product (30,000 dimensions of 2^32,
    a million-bit integer to build one multiplication at a time) must stop at the cap."""
    assert shape_elements_at_most([3, 4], 100) == 12
    assert shape_elements_at_most([0, 2**62], 100) == 0
    assert shape_elements_at_most([11, 10], 100) == 101
    assert shape_elements_at_most([1] * 100_000, 100) == 101  # too long to be valid at all
    huge = tensor_pb2.Tensor(key="s", dtype=tensor_pb2.DTYPE_BYTES, shape=[2**32] * 30_000)
    assert bytes_elements([huge]) == INLINE_BYTES_ELEMENTS + 1
    assert bytes_elements([huge] * 1000) == INLINE_BYTES_ELEMENTS + 1
