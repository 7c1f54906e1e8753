"""Edge identities are not up for grabs: a second live connection under a client's identity
cannot take its replies, a CURVE identity stays bound to its key, and a client that comes back
under its own identity (its old connection dead but never closed) is served within seconds:
ZMTP heartbeats find the dead connection and free the identity.

The gateway has no scheduler behind it, so every well-formed observation is answered
`unavailable` at once: a reply is a reply, which is all these tests look at.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from inferential import Connection

from loadmaster.common.tensors import encode_tensors
from loadmaster.v1 import edge_pb2

SETTLE_S = 0.3  # after the reply a check waits for: a duplicate or misrouted one would come by then


def _observation(request_id: str) -> list[bytes]:
    descriptors, payload = encode_tensors({"x": np.ones(2, dtype=np.float32)})
    observation = edge_pb2.Observation(model_id="double", tensors=descriptors)
    observation.metadata["request_id"] = request_id
    return [b"", observation.SerializeToString(), bytes(payload)]


def _replies(socket: zmq.Socket[Any], wait_s: float, *, expect: int | None = None) -> list[str]:
    """Request ids of the replies `socket` receives within `wait_s`; with `expect`, it stops
    `SETTLE_S` after the `expect`-th reply instead (time enough for a stray one to show)."""
    ids = []
    deadline = time.monotonic() + wait_s
    while (remaining := deadline - time.monotonic()) > 0:
        if socket.poll(int(remaining * 1000) + 1):
            frames = socket.recv_multipart()
            ids.append(edge_pb2.ModelResponse.FromString(frames[1]).metadata.get("request_id", "?"))
            if expect is not None and len(ids) == expect:
                deadline = min(deadline, time.monotonic() + SETTLE_S)
    return ids


@pytest.fixture()
def context() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _dealer(context: zmq.Context[Any], endpoint: str, identity: bytes, **curve: bytes) -> zmq.Socket[Any]:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, identity)
    socket.setsockopt(zmq.LINGER, 0)
    for option, value in curve.items():
        setattr(socket, option, value)
    socket.connect(endpoint)
    return socket


def test_an_impostor_cannot_take_a_live_client_s_replies(
    start_gateway: Callable[..., Any], context: zmq.Context[Any]
) -> None:
    gateway = start_gateway()
    owner = _dealer(context, gateway.edge, b"robot-1")
    owner.send_multipart(_observation("a1"))
    assert _replies(owner, 2.0, expect=1) == ["a1"]
    impostor = _dealer(context, gateway.edge, b"robot-1")
    impostor.send_multipart(_observation("b1"))
    time.sleep(0.3)  # the impostor's connection is up
    owner.send_multipart(_observation("a2"))
    assert _replies(owner, 2.0, expect=1) == ["a2"]
    assert "a2" not in _replies(impostor, 0.5)
    impostor.close(linger=0)
    owner.send_multipart(_observation("a3"))
    assert _replies(owner, 2.0, expect=1) == ["a3"]
    assert gateway.process.poll() is None


_STUCK_CLIENT = """
import sys, time
import numpy as np
from inferential import Connection
conn = Connection(server=sys.argv[1], client_id=sys.argv[2])
model = conn.model("double")
model.observe(x=np.ones(2, dtype=np.float32))
assert model.get_result(timeout_ms=5000) is not None
print("served", flush=True)
time.sleep(120)
"""


HEARTBEAT = {"heartbeat_ivl_ms": 300, "heartbeat_timeout_ms": 1000, "heartbeat_ttl_ms": 1000}
RESTART_S = 3.0  # the client's restart takes longer than the heartbeat timeout


def test_a_client_back_under_its_own_id_is_served_within_seconds(
    start_gateway: Callable[..., Any],
) -> None:
    gateway = start_gateway({"edge": HEARTBEAT})
    first = subprocess.Popen(
        [sys.executable, "-c", _STUCK_CLIENT, gateway.edge, "robot-7"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == b"served"
        os.kill(first.pid, signal.SIGSTOP)  # its connection stays open but answers nothing
        time.sleep(RESTART_S)
        stopped_at = time.monotonic()
        conn = Connection(server=gateway.edge, client_id="robot-7")  # the stock client, restarted
        model = conn.model("double")
        try:
            served_after = None
            while served_after is None and time.monotonic() - stopped_at < 10.0:
                model.observe(x=np.ones(2, dtype=np.float32))
                result = model.get_result(timeout_ms=500)
                if result is not None and result.get("error_code") == "unavailable":
                    served_after = time.monotonic() - stopped_at
        finally:
            conn.close()
        assert served_after is not None, "the restarted client was not served within 10 s"
        assert served_after < 3.0, served_after
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(5)


def _pair() -> tuple[bytes, bytes]:
    return zmq.curve_keypair()


def test_under_curve_an_identity_stays_bound_to_its_key(
    start_gateway: Callable[..., Any], context: zmq.Context[Any]
) -> None:
    server_public, server_secret = _pair()
    owner_public, owner_secret = _pair()
    other_public, other_secret = _pair()
    gateway = start_gateway(
        {
            "auth": {
                "curve": {
                    "server_public_key": server_public.decode(),
                    "server_secret_key": server_secret.decode(),
                    "allowed_client_keys": [owner_public.decode(), other_public.decode()],
                }
            }
        }
    )

    def dealer(public: bytes, secret: bytes) -> zmq.Socket[Any]:
        return _dealer(
            context,
            gateway.edge,
            b"robot-2",
            curve_serverkey=server_public,
            curve_publickey=public,
            curve_secretkey=secret,
        )

    owner = dealer(owner_public, owner_secret)
    owner.send_multipart(_observation("a1"))
    assert _replies(owner, 2.0, expect=1) == ["a1"]
    owner.close(linger=0)
    time.sleep(0.3)  # the owner's connection is gone: its identity is free on the socket
    other = dealer(other_public, other_secret)  # an allowed key, but not robot-2's
    other.send_multipart(_observation("b1"))
    assert _replies(other, 1.0) == []
    other.close(linger=0)
    time.sleep(0.3)
    owner = dealer(owner_public, owner_secret)
    owner.send_multipart(_observation("a2"))
    assert _replies(owner, 2.0, expect=1) == ["a2"]
    owner.close(linger=0)
    assert "identity b'robot-2'" in gateway.log_text()
