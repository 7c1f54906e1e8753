"""API keys on HTTP and gRPC: hashed, scoped, rate limited; no secret in the logs."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

READER_KEY = "lm_reader-secret-0123456789abcdefghij"
ADMIN_KEY = "lm_admin-secret-0123456789abcdefghijk"
LIMITED_KEY = "lm_limited-secret-0123456789abcdefghi"


def _entry(name: str, key: str, scopes: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest(), "scopes": scopes, **extra}


AUTH = {
    "auth": {
        "api_keys": [
            _entry("reader", READER_KEY, ["infer"]),
            _entry("ops", ADMIN_KEY, ["infer", "admin"]),
            _entry("limited", LIMITED_KEY, ["infer"], rate_per_s=0.5, burst=2),
        ]
    }
}
INFER_BODY = {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1, 2]}]}


@pytest.fixture(scope="module")
def gateway(start_gateway: Callable[..., Any]) -> Any:
    return start_gateway(AUTH, log_level="DEBUG")


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_http_needs_a_valid_key_with_the_right_scope(gateway: Any) -> None:
    with httpx.Client(base_url=gateway.http_url, timeout=10) as http:
        assert http.get("/livez").status_code == 200  # probes stay open
        assert http.get("/v2/health/live").status_code == 200
        # no scheduler behind this gateway: not ready, and the probe says why
        not_ready = http.get("/readyz")
        assert not_ready.status_code == 503 and not not_ready.json()["scheduler_connected"]
        assert http.get("/v2/health/ready").status_code == 503
        assert http.get("/healthz").json()["live"] is True
        missing = http.post("/v2/models/double/infer", json=INFER_BODY)
        assert missing.status_code == 401 and "API key" in missing.json()["error"]
        wrong = http.post("/v2/models/double/infer", json=INFER_BODY, headers=_bearer("lm_not-a-key"))
        assert wrong.status_code == 401
        basic = http.post("/v2/models/double/infer", json=INFER_BODY, headers={"Authorization": "Basic abc"})
        assert basic.status_code == 401
        # a valid key gets through auth; no scheduler is behind this gateway, so: 503
        allowed = http.post("/v2/models/double/infer", json=INFER_BODY, headers=_bearer(READER_KEY))
        assert allowed.status_code == 503, allowed.text
        denied = http.post("/v2/repository/models/double/load", headers=_bearer(READER_KEY))
        assert denied.status_code == 403 and "admin" in denied.json()["error"]
        admin = http.post("/v2/repository/models/double/load", headers=_bearer(ADMIN_KEY))
        assert admin.status_code == 503, admin.text
        strategy = {"strategy": "round_robin"}
        assert http.post("/admin/strategy", json=strategy, headers=_bearer(READER_KEY)).status_code == 403
        assert http.get("/admin/queues", headers=_bearer(READER_KEY)).status_code == 403
        assert http.post("/admin/strategy", json=strategy).status_code == 401
        assert http.post("/admin/strategy", json=strategy, headers=_bearer(ADMIN_KEY)).status_code == 503
        bad = http.post("/admin/strategy", json={"policy": 3}, headers=_bearer(ADMIN_KEY))
        assert bad.status_code == 400 and "strategy" in bad.json()["error"]


def test_http_rate_limit_per_key(gateway: Any) -> None:
    with httpx.Client(base_url=gateway.http_url, timeout=10) as http:
        codes = [
            http.post("/v2/models/double/infer", json=INFER_BODY, headers=_bearer(LIMITED_KEY)).status_code
            for _ in range(4)
        ]
        assert codes[:2] == [503, 503]  # the burst of two
        assert 429 in codes[2:]
        # other keys have their own buckets
        other = http.post("/v2/models/double/infer", json=INFER_BODY, headers=_bearer(READER_KEY))
        assert other.status_code == 503


def test_grpc_metadata_authorization(gateway: Any) -> None:
    client = triton_grpc.InferenceServerClient(gateway.grpc_address)
    tensor = triton_grpc.InferInput("x", [2], "FP32")
    tensor.set_data_from_numpy(np.ones(2, np.float32))
    try:
        assert client.is_server_live()  # health stays open
        with pytest.raises(InferenceServerException) as raised:
            client.infer("double", [tensor])
        assert raised.value.status() == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException) as raised:
            client.infer("double", [tensor], headers={"authorization": "Bearer lm_wrong"})
        assert raised.value.status() == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException) as raised:
            client.infer("double", [tensor], headers={"authorization": f"Bearer {READER_KEY}"})
        assert raised.value.status() == "StatusCode.UNAVAILABLE"  # past auth; no scheduler
        with pytest.raises(InferenceServerException) as raised:
            client.load_model("double", headers={"authorization": f"Bearer {READER_KEY}"})
        assert raised.value.status() == "StatusCode.PERMISSION_DENIED"
        with pytest.raises(InferenceServerException) as raised:
            client.load_model("double", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert raised.value.status() == "StatusCode.UNAVAILABLE"
    finally:
        client.close()


def test_no_key_appears_in_the_logs(gateway: Any) -> None:
    with httpx.Client(base_url=gateway.http_url, timeout=10) as http:
        for key in (READER_KEY, ADMIN_KEY, LIMITED_KEY, "lm_unknown-key-material"):
            http.post("/v2/models/double/infer", json=INFER_BODY, headers=_bearer(key))
            http.post("/v2/repository/models/double/unload", headers=_bearer(key))
    text = gateway.log_text()
    assert "level=debug" in text.lower() or "DEBUG" in text  # the gateway logged at DEBUG
    for secret in (READER_KEY, ADMIN_KEY, LIMITED_KEY, "lm_unknown-key-material"):
        assert secret not in text
