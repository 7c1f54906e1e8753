"""A client that stops reading its socket does not stall replies to other clients."""

from __future__ import annotations

import time
import uuid

import numpy as np
import zmq
from inferential import Connection

from loadmaster.common.tensors import encode_tensors
from loadmaster.v1 import edge_pb2


def test_a_client_that_never_reads_does_not_stall_others(make_suite) -> None:
    suite = make_suite(preload=["double"])
    edge = suite.settings.gateway.edge.bind
    context = zmq.Context()
    stalled = context.socket(zmq.DEALER)
    stalled.setsockopt(zmq.IDENTITY, b"never-reads")
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.setsockopt(zmq.LINGER, 0)
    stalled.connect(edge)
    descriptors, payload = encode_tensors({"x": np.zeros(64 * 1024, dtype=np.float32)})  # 256 KiB replies
    envelope = edge_pb2.Observation(model_id="double", tensors=descriptors).SerializeToString()
    conn = Connection(server=edge, client_id=f"reader-{uuid.uuid4().hex[:6]}")
    model = conn.model("double")
    try:
        for _ in range(300):  # far more reply bytes than the stalled socket's buffers hold
            stalled.send_multipart([b"", envelope, bytes(payload)], flags=zmq.NOBLOCK)
        worst = 0.0
        for i in range(50):
            started = time.monotonic()
            model.observe(x=np.array([i], dtype=np.float32))
            result = model.get_result(timeout_ms=5000)
            worst = max(worst, time.monotonic() - started)
            assert result is not None and "error" not in result, result
            assert result["x"][0] == 2.0 * i
        assert worst < 5.0
    finally:
        conn.close()
        stalled.close(linger=0)
        context.term()
