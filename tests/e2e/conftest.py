"""The whole suite as real processes, started by the launcher's own code on free loopback ports."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from loadmaster.cli.launcher import Suite, free_port_overrides
from loadmaster.v1 import gpu_broker_pb2, gpu_broker_pb2_grpc, metrics_pb2, metrics_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"
MODELS_DIR = ROOT / "examples" / "models"


@pytest.fixture(scope="session")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    log_dir = tmp_path_factory.mktemp("suite-logs")
    running = Suite(EXAMPLE_CONFIG, overrides=free_port_overrides(), log_dir=log_dir)
    running.start(timeout_s=120)
    try:
        running.wait_for_models(running.settings.model_pool.preload, timeout_s=120)
        yield running
    finally:
        running.stop()
        for log in sorted(log_dir.glob("*.log")):
            print(f"---- {log.name} (tail) ----\n" + "\n".join(log.read_text().splitlines()[-30:]))


@pytest.fixture()
def edge_address(suite: Suite) -> str:
    return suite.settings.gateway.edge.bind


@pytest.fixture()
def client_id() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture()
def metrics_count(suite: Suite) -> Callable[[str, dict[str, str]], int]:
    """A counter's total for these labels in the metrics service (reporters sum a counter's
    increments per batch, so its number of samples is not the number of events)."""

    def count(name: str, labels: dict[str, str]) -> int:
        with grpc.insecure_channel(suite.settings.metrics.address) as channel:
            stub = metrics_pb2_grpc.MetricsServiceStub(channel)
            reply = stub.GetStats(metrics_pb2.GetStatsRequest(name=name, labels=labels), timeout=5)
        return round(reply.stats.sum)

    return count


@pytest.fixture()
def list_leases(suite: Suite) -> Callable[[], list[gpu_broker_pb2.Lease]]:
    def leases() -> list[gpu_broker_pb2.Lease]:
        with grpc.insecure_channel(suite.settings.gpu_broker.address) as channel:
            stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
            return list(stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(), timeout=5).leases)

    return leases


@pytest.fixture()
def models_dir() -> Path:
    return MODELS_DIR
