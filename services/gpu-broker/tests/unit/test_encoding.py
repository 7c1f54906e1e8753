"""Storage encoding (Redis fields, event messages) and protobuf conversion."""

from __future__ import annotations

import json

import hiredis
import pytest
from redis.exceptions import NoScriptError, ResponseError

from loadmaster.gpu_broker._coalesce import _pack_in_python, new_reader, reply_value
from loadmaster.gpu_broker.leases import GpuState, LeaseEventKind
from loadmaster.gpu_broker.servicer import acquire_from_proto, event_to_proto, gpu_to_proto
from loadmaster.gpu_broker.store import (
    decode_alloc,
    decode_event,
    encode_alloc,
    event_from_message,
    lease_from_fields,
)
from loadmaster.v1 import gpu_broker_pb2 as pb

FIELDS = {
    "id": "abc",
    "holder": "worker-1",
    "node": "n1",
    "alloc": "0=1024,3=512",
    "labels": json.dumps({"model": "resnet"}),
    "created_ms": "1700000000000",
    "expires_ms": "1700000030000",
    "token": "42",
}


def test_alloc_round_trips_sorted() -> None:
    assert encode_alloc({3: 512, 0: 1024}) == "0=1024,3=512"
    assert decode_alloc("0=1024,3=512") == {0: 1024, 3: 512}
    assert decode_alloc("") == {}


def test_lease_from_fields() -> None:
    lease = lease_from_fields(FIELDS)
    assert lease.mb_per_gpu == {0: 1024, 3: 512}
    assert lease.total_mb == 1536
    assert lease.labels == {"model": "resnet"}
    assert (lease.expires_unix_ms, lease.fencing_token) == (1_700_000_030_000, 42)


def test_event_message_decodes_and_converts_to_proto() -> None:
    event = event_from_message(json.dumps({"kind": "expired", "ts": "1700000031000", "lease": FIELDS}))
    assert event.kind is LeaseEventKind.EXPIRED
    message = event_to_proto(event)
    assert message.kind == pb.WatchResponse.KIND_EXPIRED
    assert dict(message.lease.mb_per_gpu) == {0: 1024, 3: 512}
    assert message.timestamp_unix_ms == 1_700_000_031_000


def test_malformed_event_message_raises() -> None:
    with pytest.raises((ValueError, KeyError)):
        event_from_message(json.dumps({"kind": "bogus", "ts": "1", "lease": FIELDS}))
    assert decode_event(json.dumps({"kind": "bogus", "ts": "1", "lease": FIELDS})) is None  # logged, skipped
    assert decode_event("not json") is None
    assert decode_event(json.dumps({"kind": "renewed", "ts": "1", "lease": FIELDS})) is not None


def test_gpu_to_proto_reports_free_memory() -> None:
    gpu = GpuState(node="n", index=1, total_mb=8_000, reserve_mb=500, used_outside_mb=500, leased_mb=1_000)
    assert gpu_to_proto(gpu).free_mb == 6_000


def test_acquire_from_proto_dedupes_gpus() -> None:
    request = acquire_from_proto(pb.AcquireRequest(holder="h", node="n", mb=5, gpus=[2, 0, 2], ttl_s=3))
    assert request.placement.gpus == (0, 2)
    assert request.ttl_s == 3


@pytest.mark.parametrize(
    "args",
    [
        ("EVALSHA", "0" * 40, 3, "k1", "k2", "k3", "prefix", 1_700_000_000_000, "ch"),
        ("SCRIPT", "LOAD", "return 'é'"),  # byte lengths, not character counts
        ("PING",),
        ("SET", "", -1),
    ],
)
def test_commands_packed_in_python_match_hiredis(args: tuple[str | int, ...]) -> None:
    """The fallback packer (hiredis older than 2.1) writes exactly what hiredis writes."""
    assert hiredis.pack_command(args) == _pack_in_python(args)


def test_error_replies_become_redis_py_exceptions() -> None:
    reader = new_reader()
    reader.feed(b"*3\r\n-NOSCRIPT No matching script\r\n:5\r\n-ERR boom\r\n")
    noscript, five, error = reader.gets()
    assert isinstance(reply_value(noscript), NoScriptError)
    assert reply_value(five) == 5
    assert isinstance(reply_value(error), ResponseError) and "boom" in str(reply_value(error))
