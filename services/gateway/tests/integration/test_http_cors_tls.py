"""Browsers and TLS on the gateway's HTTP port, against a real gateway process (no scheduler):
CORS preflights from an allowed and a refused origin, none answered without `cors_origins`,
and HTTPS with a certificate from a CA this test makes (tests/unit/pki.py)."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from pki import TestCa

ALLOWED = "https://app.example"
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type, x-loadmaster-priority",
}


def test_a_preflight_from_an_allowed_origin_is_answered_and_others_refused(
    start_gateway: Callable[..., Any],
) -> None:
    gateway = start_gateway({"cors_origins": [ALLOWED]})
    url = gateway.http_url + "/v1/chat/completions"
    allowed = httpx.options(url, headers={"Origin": ALLOWED, **PREFLIGHT}, timeout=10)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "x-loadmaster-priority" in allowed.headers["access-control-allow-headers"].lower()
    refused = httpx.options(url, headers={"Origin": "https://evil.example", **PREFLIGHT}, timeout=10)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    simple = httpx.get(gateway.http_url + "/api/version", headers={"Origin": ALLOWED}, timeout=10)
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == ALLOWED
    assert "x-loadmaster-model" in simple.headers["access-control-expose-headers"].lower()


def test_without_cors_origins_no_preflight_is_answered(start_gateway: Callable[..., Any]) -> None:
    gateway = start_gateway()
    response = httpx.options(
        gateway.http_url + "/v1/chat/completions", headers={"Origin": ALLOWED, **PREFLIGHT}, timeout=10
    )
    assert response.status_code == 405 and "access-control-allow-origin" not in response.headers


def test_the_http_port_speaks_tls_with_its_certificate(
    start_gateway: Callable[..., Any], tmp_path: Path
) -> None:
    ca = TestCa(tmp_path)
    cert, key = ca.issue("gateway", ["127.0.0.1", "localhost"])
    gateway = start_gateway({"tls_cert_file": str(cert), "tls_key_file": str(key)})
    https = gateway.http_url.replace("http://", "https://")
    trusted = ssl.create_default_context(cafile=str(ca.ca_file))
    version = httpx.get(https + "/api/version", verify=trusted, timeout=10)
    assert version.status_code == 200 and version.json()["version"]
    with pytest.raises(ollama.ResponseError) as caught:  # through TLS to the route: no scheduler here
        ollama.Client(host=https, verify=trusted).chat(
            model="tiny-chat", messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 503
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(https + "/api/version", timeout=10)  # the system CAs do not know the test CA
    with pytest.raises(httpx.HTTPError):
        httpx.get(gateway.http_url + "/api/version", timeout=10)  # no plain HTTP on a TLS port
