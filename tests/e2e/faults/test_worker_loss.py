"""kill -9 a model-pool worker with requests in flight: every affected request is retried on the
other worker or answered with an error within 2 s; none is lost or answered twice."""

from __future__ import annotations

import os
import signal
import time
import uuid

import numpy as np
import pytest
import zmq
from inferential.proto import ModelResponse

from loadmaster.common.tensors import encode_tensors
from loadmaster.v1 import edge_pb2

pytestmark = pytest.mark.slow


def _observation(request_id: str, ms: float) -> tuple[bytes, bytes]:
    descriptors, payload = encode_tensors({"ms": np.array([ms], dtype=np.float32)})
    observation = edge_pb2.Observation(model_id="sleep", tensors=descriptors)
    observation.client.id = "fault-client"
    observation.metadata["request_id"] = request_id
    return observation.SerializeToString(), bytes(payload)


def test_killing_a_worker_with_requests_in_flight_loses_none(make_suite) -> None:
    suite = make_suite(workers=2, preload=["sleep"], models={"known": {"sleep": {"max_inflight": 4}}})
    context = zmq.Context()
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.IDENTITY, f"fault-{uuid.uuid4().hex[:6]}".encode())
    client.setsockopt(zmq.LINGER, 0)
    client.connect(suite.settings.gateway.edge.bind)
    try:
        # Eight 300 ms requests: even run one by one on the survivor they fit in the 5 s TTL,
        # so every request the dead worker held must come back retried, not expired.
        sent = [f"r{i}" for i in range(8)]
        for request_id in sent:
            client.send_multipart([b"", *_observation(request_id, 300.0)])
        time.sleep(0.15)  # let both workers start their first requests
        victim = suite.service("model-pool-1")
        assert victim is not None
        os.kill(victim.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()

        replies: dict[str, list[dict[str, str]]] = {}
        deadline = killed_at + 8 * 0.3 + 2  # the survivor runs everything one by one at worst
        while len(replies) < len(sent) and time.monotonic() < deadline:
            if client.poll(100):
                frames = client.recv_multipart()
                response = ModelResponse.FromString(frames[1])
                replies.setdefault(response.metadata["request_id"], []).append(dict(response.metadata))
        time.sleep(1.0)  # anything answered twice would show up now
        while client.poll(0):
            frames = client.recv_multipart()
            response = ModelResponse.FromString(frames[1])
            replies.setdefault(response.metadata["request_id"], []).append(dict(response.metadata))

        assert sorted(replies) == sorted(sent), f"lost: {set(sent) - set(replies)}"
        assert time.monotonic() - killed_at < 8 * 0.3 + 2 + 1.5
        assert all(len(answers) == 1 for answers in replies.values()), "a request was answered twice"
        errors = {rid: a[0]["error_code"] for rid, a in replies.items() if "error_code" in a[0]}
        # With max_retries 1 the killed worker's requests are re-granted to the survivor.
        assert errors == {}, errors
    finally:
        client.close(linger=0)
        context.term()
