"""A real gateway process on free loopback ports, with no scheduler behind it.

The gateway runs as `python -m loadmaster.gateway` (its own process group, killed in
teardown) rather than in the test process: its `inference` protos and a stock
tritonclient's copy of them cannot share one process's descriptor pool, and e2e tests
load tritonclient. Its scheduler port is closed, so every well-formed request is
answered `unavailable` at once — enough for auth, limits, CURVE and fuzzing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadmaster.common.grpc_client import wait_for_health_sync
from loadmaster.common.ports import free_port


@dataclass(frozen=True, slots=True)
class GatewayProcess:
    process: subprocess.Popen[bytes]
    grpc_address: str
    http_url: str
    edge: str
    log_path: Path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


@pytest.fixture(scope="module")
def start_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., GatewayProcess]]:
    """Start gateways for a module's tests (each test module shares what it starts)."""
    tmp_path = tmp_path_factory.mktemp("gateway")
    started: list[GatewayProcess] = []

    def start(
        gateway: dict[str, Any] | None = None,
        *,
        log_level: str = "INFO",
        scheduler_address: str = "",
        redis_url: str = "",
        top_level: dict[str, Any] | None = None,
    ) -> GatewayProcess:
        grpc_port, http_port, edge_port = free_port(), free_port(), free_port()
        config = {
            "log_level": log_level,
            "gateway": _merge(
                {
                    "address": f"127.0.0.1:{grpc_port}",
                    "http_host": "127.0.0.1",
                    "http_port": http_port,
                    "edge": {"bind": f"tcp://127.0.0.1:{edge_port}"},
                    # Inside the teardown's 10 s wait, so a gateway that cannot drain says why.
                    "shutdown_grace_s": 8.0,
                },
                gateway or {},
            ),
            "scheduler": {"address": scheduler_address or f"127.0.0.1:{free_port()}"},
            "metrics": {"enabled": False},
        }
        if redis_url:
            config["redis_url"] = redis_url
        config.update(top_level or {})
        index = len(started)
        config_path = tmp_path / f"gateway-{index}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        log_path = tmp_path / f"gateway-{index}.log"
        # Redis only when asked for (async image jobs): REDIS_URL would turn them on.
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOADMASTER_") and k != "REDIS_URL"}
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "loadmaster.gateway", "--config", str(config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        running = GatewayProcess(
            process,
            f"127.0.0.1:{grpc_port}",
            f"http://127.0.0.1:{http_port}",
            f"tcp://127.0.0.1:{edge_port}",
            log_path,
        )
        started.append(running)
        try:
            wait_for_health_sync(running.grpc_address, timeout_s=30)
        except TimeoutError:
            raise AssertionError(f"gateway did not start:\n{running.log_text()}") from None
        return running

    yield start
    for running in started:
        if running.process.poll() is None:
            os.killpg(running.process.pid, signal.SIGTERM)
            try:
                running.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(running.process.pid, signal.SIGKILL)
                running.process.wait(5)
