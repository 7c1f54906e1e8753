"""An edge client's requests in the gateway are held to a byte budget
(`gateway.edge.max_inflight_request_bytes`, 16 MiB): past it they are refused `overflow` at
once instead of waiting in the gateway with their payloads (a client pipelining 2000 x 256 KB
grew the gateway by 200-500 MB). A single request larger than the budget still passes."""

from __future__ import annotations

import uuid

import numpy as np
import zmq

from loadmaster.cli.launcher import Suite
from loadmaster.common.framing import ERROR_CODE_KEY, ERROR_KEY, REQUEST_ID_KEY
from loadmaster.common.tensors import decode_tensors, encode_tensors
from loadmaster.v1 import edge_pb2

MIB = 1 << 20


def _observation(model_id: str, arrays: dict[str, np.ndarray], request_id: str) -> list[bytes]:
    descriptors, payload = encode_tensors(arrays)
    observation = edge_pb2.Observation(model_id=model_id, tensors=descriptors)
    observation.metadata[REQUEST_ID_KEY] = request_id
    return [b"", observation.SerializeToString(), bytes(payload)]


def test_requests_past_a_clients_inflight_budget_are_refused_overflow(suite: Suite) -> None:
    budget = suite.settings.gateway.edge.max_inflight_request_bytes
    pad = np.zeros((4 * MIB - 64) // 4, dtype=np.float32)  # just under 4 MiB a request, with `ms`
    count = budget // pad.nbytes + 4  # four past the budget
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, f"pipeliner-{uuid.uuid4().hex[:6]}".encode())
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(suite.settings.gateway.edge.bind)
    try:
        for i in range(count):  # each sleeps 400 ms in the worker: all are sent before one is answered
            dealer.send_multipart(
                _observation("sleep", {"ms": np.array([400.0], np.float32), "pad": pad}, f"r{i}")
            )
        replies: dict[str, edge_pb2.ModelResponse] = {}
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        for _ in range(count):
            assert poller.poll(30_000), f"only {len(replies)} of {count} replies"
            frames = dealer.recv_multipart()
            response = edge_pb2.ModelResponse.FromString(frames[1])
            replies[response.response_id] = response
        codes = {key: r.metadata.get(ERROR_CODE_KEY, "ok") for key, r in replies.items()}
        refused = [key for key, code in codes.items() if code == "overflow"]
        assert len(refused) == 4 and list(codes.values()).count("ok") == count - 4, codes
        assert all("awaiting replies" in replies[key].metadata[ERROR_KEY] for key in refused)
        # Once its replies are in, the client's budget is whole again; and a single request
        # larger than the budget passes when it has nothing else in flight.
        big = np.ones((budget + MIB) // 4, dtype=np.float32)
        dealer.send_multipart(_observation("sleep", {"ms": np.array([0.0], np.float32), "pad": big}, "big"))
        assert poller.poll(30_000)
        frames = dealer.recv_multipart()
        response = edge_pb2.ModelResponse.FromString(frames[1])
        assert ERROR_CODE_KEY not in response.metadata, response.metadata.get(ERROR_KEY)
        assert decode_tensors(response.tensors, frames[2])["pad"].nbytes == big.nbytes
    finally:
        context.destroy(linger=0)
