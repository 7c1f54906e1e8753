"""A client that never reads its replies cannot pin the gateway's memory: past its byte budget
its replies are dropped and counted, the gateway's resident memory stays within twice the
payload limit of its idle size, and another client is served all along."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
import zmq
from inferential import Connection

from loadmaster.common.tensors import encode_tensors
from loadmaster.v1 import edge_pb2, metrics_pb2, metrics_pb2_grpc

pytestmark = pytest.mark.slow

REQUESTS = 2000  # x 256 KiB replies = 500 MiB if they were all kept
PAYLOAD_LIMIT = 64 << 20  # the default limits.max_payload_bytes


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _dropped(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = metrics_pb2_grpc.MetricsServiceStub(channel)
        request = metrics_pb2.GetStatsRequest(name="replies_dropped", labels={"reason": "byte_budget"})
        return round(stub.GetStats(request, timeout=5).stats.sum)


def test_a_client_that_never_reads_is_held_to_its_byte_budget(make_suite) -> None:
    suite = make_suite(preload=["double"])
    gateway = suite.service("gateway")
    assert gateway is not None
    edge = suite.settings.gateway.edge.bind
    reader = Connection(server=edge, client_id=f"reader-{uuid.uuid4().hex[:6]}")
    model = reader.model("double")

    def ask(value: float) -> None:
        model.observe(x=np.array([value], dtype=np.float32))
        result = model.get_result(timeout_ms=10_000)
        assert result is not None and "error" not in result, result
        assert result["x"][0] == 2.0 * value

    context = zmq.Context()
    stalled = context.socket(zmq.DEALER)
    stalled.setsockopt(zmq.IDENTITY, f"never-reads-{uuid.uuid4().hex[:6]}".encode())
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.setsockopt(zmq.LINGER, 0)
    stalled.connect(edge)
    descriptors, payload = encode_tensors({"x": np.zeros(64 * 1024, dtype=np.float32)})  # 256 KiB
    envelope = edge_pb2.Observation(model_id="double", tensors=descriptors).SerializeToString()
    try:
        for i in range(5):
            ask(float(i))
        idle = _rss_bytes(gateway.process.pid)
        for i in range(REQUESTS):
            stalled.send_multipart([b"", envelope, bytes(payload)])
            if i % 50 == 49:  # the other client is served meanwhile (and paces the sender)
                ask(float(i))
        ask(-1.0)  # behind everything the stalled client sent
        time.sleep(1.0)
        grown = _rss_bytes(gateway.process.pid) - idle
        print(f"gateway RSS grew by {grown / 2**20:.0f} MiB over {REQUESTS} unread 256 KiB replies")
        assert grown < 2 * PAYLOAD_LIMIT, f"{grown / 2**20:.0f} MiB"
        deadline = time.monotonic() + 10  # reporters flush in batches
        while _dropped(suite.settings.metrics.address) == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _dropped(suite.settings.metrics.address) > REQUESTS // 2
    finally:
        reader.close()
        stalled.close(linger=0)
        context.term()
