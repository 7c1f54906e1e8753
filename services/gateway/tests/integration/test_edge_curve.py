"""CurveZMQ on the edge: only clients with an allowed key pair get replies; no secret in the logs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from loadmaster.client import Connection, CurveKeys, NoReplyError
from loadmaster.common.errors import UnavailableError


def _pair() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def test_curve_edge_admits_only_allowed_clients(start_gateway: Callable[..., Any]) -> None:
    server_public, server_secret = _pair()
    client_public, client_secret = _pair()
    stranger_public, stranger_secret = _pair()
    gateway = start_gateway(
        {
            "auth": {
                "curve": {
                    "server_public_key": server_public,
                    "server_secret_key": server_secret,
                    "allowed_client_keys": [client_public],
                }
            }
        },
        log_level="DEBUG",
    )
    x = np.ones(2, dtype=np.float32)
    allowed = CurveKeys(server_public, client_public, client_secret)
    # the handshake works and the gateway answers (it has no scheduler: unavailable)
    with Connection(gateway.edge, curve=allowed) as conn, pytest.raises(UnavailableError):
        conn.model("double").infer(x=x, timeout_ms=2000)
    stranger = CurveKeys(server_public, stranger_public, stranger_secret)
    with Connection(gateway.edge, curve=stranger) as conn, pytest.raises(NoReplyError):
        conn.model("double").infer(x=x, timeout_ms=300)
    with Connection(gateway.edge) as conn, pytest.raises(NoReplyError):  # no CURVE at all
        conn.model("double").infer(x=x, timeout_ms=300)
    assert gateway.process.poll() is None
    text = gateway.log_text()
    assert "CURVE" in text
    assert server_secret not in text and client_secret not in text and stranger_secret not in text


def test_curve_without_an_allow_list_admits_any_client_with_the_server_key(
    start_gateway: Callable[..., Any],
) -> None:
    server_public, server_secret = _pair()
    gateway = start_gateway({"auth": {"curve": {"server_secret_key": server_secret}}})
    with Connection(gateway.edge, curve=CurveKeys(server_public)) as conn, pytest.raises(UnavailableError):
        conn.model("double").infer(x=np.ones(1, np.float32), timeout_ms=2000)
