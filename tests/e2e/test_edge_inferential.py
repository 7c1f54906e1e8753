"""The stock Inferential client (PyPI inferential==1.4.0) against the running suite."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from inferential import Connection
from inferential.proto import FLOAT32, RAW, Client, Observation, Tensor

from loadmaster.cli.launcher import Suite

TIMEOUT_MS = 10_000


@pytest.fixture()
def conn(edge_address: str, client_id: str):
    connection = Connection(server=edge_address, client_id=client_id)
    yield connection
    connection.close()


def test_double_returns_twice_the_input(conn: Connection) -> None:
    model = conn.model("double")
    x = np.arange(7, dtype=np.float32)
    model.observe(x=x)
    result = model.get_result(timeout_ms=TIMEOUT_MS)
    assert result is not None, "no reply"
    assert "error" not in result, result
    np.testing.assert_array_equal(result["x"], x * 2)
    assert result["x"].dtype == np.float32
    assert result["model_id"] == "double"


@pytest.mark.parametrize("model_id", ["policy", "classifier"])
def test_torch_models_match_their_reference_outputs(
    conn: Connection, model_id: str, models_dir: Path
) -> None:
    reference = np.load(models_dir / model_id / "artifacts" / "reference.npz")
    inputs = {
        key.removeprefix("input."): reference[key] for key in reference.files if key.startswith("input.")
    }
    outputs = {
        key.removeprefix("output."): reference[key] for key in reference.files if key.startswith("output.")
    }
    assert inputs and outputs
    model = conn.model(model_id)
    model.observe(**inputs)
    result = model.get_result(timeout_ms=TIMEOUT_MS)
    assert result is not None, "no reply"
    assert "error" not in result, result
    for key, expected in outputs.items():
        np.testing.assert_allclose(result[key], expected, rtol=1e-4, atol=1e-5)


def test_unknown_model_is_answered_not_found(conn: Connection) -> None:
    model = conn.model("no-such-model")
    model.observe(x=np.zeros(3, dtype=np.float32))
    result = model.get_result(timeout_ms=TIMEOUT_MS)
    assert result is not None, "no reply"
    assert result["error_code"] == "not_found"
    assert "no-such-model" in result["error"]


def test_bad_byte_length_is_invalid_and_the_next_request_succeeds(conn: Connection) -> None:
    observation = Observation(model_id="double", client=Client(id="bad-client"))
    observation.tensors.append(
        Tensor(key="x", dtype=FLOAT32, shape=[7], byte_offset=0, byte_length=20, encoding=RAW)
    )
    conn._send(observation.SerializeToString(), b"\x00" * 20)
    model = conn.model("double")
    bad = model.get_result(timeout_ms=TIMEOUT_MS)
    assert bad is not None, "no reply to the invalid observation"
    assert bad["error_code"] == "invalid_argument"
    assert "'x'" in bad["error"] and "byte_length" in bad["error"]

    model.observe(x=np.ones(7, dtype=np.float32))
    good = model.get_result(timeout_ms=TIMEOUT_MS)
    assert good is not None and "error" not in good, good
    np.testing.assert_array_equal(good["x"], np.full(7, 2, dtype=np.float32))


def test_pipelined_observations_are_answered_in_order(conn: Connection) -> None:
    model = conn.model("double")
    for i in range(100):
        model.observe(x=np.array([i], dtype=np.float32))
    values = []
    for _ in range(100):
        result = model.get_result(timeout_ms=TIMEOUT_MS)
        assert result is not None and "error" not in result, result
        values.append(float(result["x"][0]))
    assert values == [2.0 * i for i in range(100)]


def test_the_metrics_service_counts_every_request(conn: Connection, metrics_count) -> None:
    # Earlier tests' calls may still be on their way to the metrics service (reports leave about
    # once a second): start from a count that has stopped moving.
    before = metrics_count("requests", {"model": "sleep", "code": "ok"})
    for _ in range(8):
        time.sleep(1.2)
        now = metrics_count("requests", {"model": "sleep", "code": "ok"})
        if now == before:
            break
        before = now
    model = conn.model("sleep")
    for _ in range(12):
        model.observe(ms=np.array([1.0], dtype=np.float32))
        result = model.get_result(timeout_ms=TIMEOUT_MS)
        assert result is not None and "error" not in result, result
    deadline = time.monotonic() + 10
    count = before
    while time.monotonic() < deadline:
        count = metrics_count("requests", {"model": "sleep", "code": "ok"})
        if count >= before + 12:
            break
        time.sleep(0.1)
    assert count == before + 12


def test_the_worker_holds_a_gpu_lease_for_each_loaded_model(suite: Suite, list_leases) -> None:
    leases = list_leases()
    leased_models = {lease.labels.get("model") for lease in leases}
    assert set(suite.settings.model_pool.preload) <= leased_models
    assert all(lease.fencing_token > 0 and lease.expires_unix_ms > time.time() * 1000 for lease in leases)
