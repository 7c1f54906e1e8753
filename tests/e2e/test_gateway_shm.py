"""Image payloads between the real gateway and worker processes through shared memory.

The suite's data endpoint is on loopback, so the gateway places payloads of 64 KiB and
more in its region under /dev/shm; the metrics service counts each one (`shm_payloads`).
Then the gateway is stopped (its region must be gone) and started again with shared
memory off, and the same images go on the socket.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from loadmaster.cli.launcher import Suite, free_port_overrides
from loadmaster.client import Connection
from loadmaster.common.shm import REGION_PREFIX, SHM_DIRECTORY
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
IMAGE = np.random.default_rng(0).integers(0, 255, (480, 640, 3), dtype=np.uint8)
SMALL = np.arange(7, dtype=np.float32)


@pytest.fixture(scope="module")
def shm_suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = ["double"]
    suite = Suite(
        ROOT / "examples" / "loadmaster.yaml",
        overrides=overrides,
        log_dir=tmp_path_factory.mktemp("shm-suite"),
    )
    suite.start(timeout_s=120)
    try:
        suite.wait_for_models(["double"], timeout_s=120)
        yield suite
    finally:
        suite.stop()


def regions_of(pid: int) -> list[Path]:
    return sorted(SHM_DIRECTORY.glob(f"{REGION_PREFIX}{pid}-*"))


def gateway_pid(suite: Suite) -> int:
    gateway = suite.service("gateway")
    assert gateway is not None
    return gateway.process.pid


def count(suite: Suite, name: str, labels: dict[str, str]) -> int:
    with grpc.insecure_channel(suite.settings.metrics.address) as channel:
        stub = metrics_pb2_grpc.MetricsServiceStub(channel)
        reply = stub.GetStats(metrics_pb2.GetStatsRequest(name=name, labels=labels), timeout=5)
    return round(reply.stats.sum)  # a counter: its increments, summed per report batch


def wait_for_count(suite: Suite, name: str, labels: dict[str, str], at_least: int) -> int:
    deadline = time.monotonic() + 20
    while (seen := count(suite, name, labels)) < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    return seen


def infer_images(suite: Suite, n: int) -> None:
    with Connection(suite.settings.gateway.edge.bind) as conn:
        model = conn.model("double")
        for i in range(n):
            image = np.roll(IMAGE, i)
            np.testing.assert_array_equal(model.infer(x=image)["x"], image * np.uint8(2))
        assert model.infer(x=SMALL)["x"].tolist() == (SMALL * 2).tolist()


def test_images_go_through_shared_memory(shm_suite: Suite) -> None:
    infer_images(shm_suite, 5)
    assert wait_for_count(shm_suite, "shm_payloads", {"model": "double"}, 5) == 5  # not the small one
    assert len(regions_of(gateway_pid(shm_suite))) == 1


def test_the_region_is_unlinked_on_stop_and_disabled_shm_uses_the_socket(shm_suite: Suite) -> None:
    pid = gateway_pid(shm_suite)
    assert regions_of(pid)
    gateway = shm_suite.service("gateway")
    assert gateway is not None
    os.killpg(pid, signal.SIGTERM)
    assert gateway.process.wait(20) == 0
    assert regions_of(pid) == []

    shm_suite.overrides["gateway"]["shm"] = {"enabled": False}  # the next gateway's environment
    shm_suite.start_service("gateway", timeout_s=60)
    before = count(shm_suite, "shm_payloads", {"model": "double"})
    ok_before = count(shm_suite, "requests", {"model": "double", "code": "ok"})
    infer_images(shm_suite, 3)
    # The gateway reports a request's samples together: once its `requests` arrived, any
    # `shm_payloads` of the same requests have too.
    assert (
        wait_for_count(shm_suite, "requests", {"model": "double", "code": "ok"}, ok_before + 4)
        >= ok_before + 4
    )
    assert count(shm_suite, "shm_payloads", {"model": "double"}) == before
    assert regions_of(gateway_pid(shm_suite)) == []
