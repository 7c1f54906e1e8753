"""Three gateways behind one address through a real HAProxy (Debian's, `make haproxy`),
configured from deploy/haproxy/haproxy.cfg.template the way docs/deploy.md says: the edge
(ZMQ) and KServe gRPC in TCP mode, REST in HTTP mode. Every request through the balancer is
answered, and every gateway answered some (HAProxy's per-server sessions and the gateways'
own `requests` counters in the metrics service)."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from inferential import Connection

from loadmaster.cli.launcher import Suite, free_port_overrides, to_env
from loadmaster.common.child_processes import die_with_parent
from loadmaster.common.grpc_client import wait_for_health_sync
from loadmaster.common.ports import free_port

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"
RENDER = ROOT / "deploy" / "haproxy" / "render.py"
GATEWAYS = 3
CONNECTIONS = 6  # per long-lived protocol: leastconn spreads them two per gateway

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("haproxy_render", RENDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _wait_port(port: int, timeout_s: float, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"haproxy exited with code {process.returncode} (see haproxy.log below)")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s:.0f}s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@pytest.fixture(scope="module")
def balanced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("haproxy is not installed (`make haproxy` installs Debian's; it could not here)")
    logs = tmp_path_factory.mktemp("haproxy-suite")
    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = ["double"]
    suite = Suite(
        EXAMPLE_CONFIG,
        overrides=overrides,
        log_dir=logs,
        services=("gpu-broker", "metrics", "scheduler", "model-pool"),
    )
    gateways: list[tuple[subprocess.Popen[bytes], dict[str, int]]] = []
    balancer: subprocess.Popen[bytes] | None = None
    try:
        suite.start(timeout_s=120)
        suite.wait_for_models(["double"], timeout_s=120)
        for index in range(GATEWAYS):
            ports = {"edge": free_port(), "grpc": free_port(), "http": free_port()}
            env = {
                **suite.env,
                **to_env(
                    {
                        "gateway": {
                            "address": f"127.0.0.1:{ports['grpc']}",
                            "http_port": ports["http"],
                            "edge": {"bind": f"tcp://127.0.0.1:{ports['edge']}"},
                            "gr00t": {"bind": f"tcp://127.0.0.1:{free_port()}"},  # (the suite's is taken)
                        }
                    }
                ),
            }
            log = (logs / f"gateway-{index}.log").open("ab")
            process = subprocess.Popen(
                die_with_parent(
                    [sys.executable, "-m", "loadmaster.gateway", "--config", str(EXAMPLE_CONFIG)]
                ),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            log.close()
            gateways.append((process, ports))
        for process, ports in gateways:
            wait_for_health_sync(f"127.0.0.1:{ports['grpc']}", timeout_s=90)
            assert process.poll() is None
        front = {"edge": free_port(), "grpc": free_port(), "http": free_port()}
        renderer = _renderer()
        socket_path = logs / "haproxy.sock"
        config = renderer.render(
            [renderer.Gateway("127.0.0.1", p["edge"], p["grpc"], p["http"]) for _, p in gateways],
            edge_bind=f"127.0.0.1:{front['edge']}",
            grpc_bind=f"127.0.0.1:{front['grpc']}",
            http_bind=f"127.0.0.1:{front['http']}",
            stats_socket=str(socket_path),
        )
        config_path = logs / "haproxy.cfg"
        config_path.write_text(config)
        balancer = subprocess.Popen(
            die_with_parent([haproxy, "-db", "-f", str(config_path)]),
            stdin=subprocess.DEVNULL,
            stdout=(logs / "haproxy.log").open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for port in front.values():
            _wait_port(port, 20, balancer)
        _wait_all_up(socket_path, timeout_s=30)
        yield {"suite": suite, "front": front, "socket": socket_path, "gateways": gateways}
    finally:
        if balancer is not None:
            _stop(balancer)
        for process, _ in gateways:
            _stop(process)
        suite.stop()
        for log_path in sorted(logs.glob("*.log")):
            print(f"---- {log_path.name} (tail) ----\n" + "\n".join(log_path.read_text().splitlines()[-20:]))


def _show_stat(socket_path: Path) -> list[dict[str, str]]:
    with socket.socket(socket.AF_UNIX) as unix:
        unix.settimeout(5)
        unix.connect(str(socket_path))
        unix.sendall(b"show stat\n")
        chunks = []
        while chunk := unix.recv(65536):
            chunks.append(chunk)
    text = b"".join(chunks).decode().lstrip("# ")
    return list(csv.DictReader(io.StringIO(text)))


def _servers(socket_path: Path, backend: str) -> dict[str, dict[str, str]]:
    return {
        row["svname"]: row
        for row in _show_stat(socket_path)
        if row["pxname"] == backend and row["svname"] not in ("FRONTEND", "BACKEND")
    }


def _wait_all_up(socket_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            rows = [
                row
                for b in ("gateways_edge", "gateways_grpc", "gateways_http")
                for row in _servers(socket_path, b).values()
            ]
            if len(rows) == 3 * GATEWAYS and all(row["status"] == "UP" for row in rows):
                return
        time.sleep(0.3)
    raise TimeoutError(f"HAProxy does not see every gateway UP: {_show_stat(socket_path)}")


def _ok_counts(metrics_url: str) -> dict[str, float]:
    """`loadmaster_gateway_requests_total{code="ok"}` summed per replica (reporting gateway)."""
    text = httpx.get(metrics_url, timeout=5).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("loadmaster_gateway_requests_total{") or 'code="ok"' not in line:
            continue
        replica = re.search(r'replica="([^"]*)"', line)
        assert replica is not None, line
        counts[replica.group(1)] = counts.get(replica.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_every_protocol_through_haproxy_is_answered_by_every_gateway(balanced: dict[str, object]) -> None:
    front: dict[str, int] = balanced["front"]  # type: ignore[assignment]
    socket_path: Path = balanced["socket"]  # type: ignore[assignment]
    suite: Suite = balanced["suite"]  # type: ignore[assignment]
    x = np.arange(4, dtype=np.float32)

    # KServe gRPC (TCP mode): one connection per client (gRPC would otherwise share one
    # connection between channels to the same address); leastconn spreads the connections.
    grpc_clients = [
        triton_grpc.InferenceServerClient(
            f"127.0.0.1:{front['grpc']}", channel_args=[("grpc.use_local_subchannel_pool", 1)]
        )
        for _ in range(CONNECTIONS)
    ]
    try:
        for round_ in range(3):
            for client in grpc_clients:
                tensor = triton_grpc.InferInput("x", [4], "FP32")
                tensor.set_data_from_numpy(x + round_)
                reply = client.infer("double", [tensor], client_timeout=20)
                np.testing.assert_array_equal(reply.as_numpy("x"), (x + round_) * 2)
    finally:
        for client in grpc_clients:
            client.close()

    # KServe HTTP (HTTP mode): one keep-alive client; every request is balanced on its own.
    http_client = triton_http.InferenceServerClient(f"127.0.0.1:{front['http']}", network_timeout=20)
    try:
        for i in range(3 * GATEWAYS):
            tensor = triton_http.InferInput("x", [4], "FP32")
            tensor.set_data_from_numpy(x + i)
            reply = http_client.infer("double", [tensor])
            np.testing.assert_array_equal(reply.as_numpy("x"), (x + i) * 2)
    finally:
        http_client.close()

    # The edge (ZMQ through TCP mode): each Connection is one TCP connection to one gateway.
    connections = [
        Connection(server=f"tcp://127.0.0.1:{front['edge']}", client_id=f"robot-{i}")
        for i in range(CONNECTIONS)
    ]
    try:
        for round_ in range(3):
            for connection in connections:
                model = connection.model("double")
                model.observe(x=x + round_)
                result = model.get_result(timeout_ms=20_000)
                assert result is not None, "no reply through the balancer"
                assert "error" not in result, result
                np.testing.assert_array_equal(result["x"], (x + round_) * 2)
    finally:
        for connection in connections:
            connection.close()

    # HAProxy sent each protocol's traffic to every gateway.
    for backend in ("gateways_edge", "gateways_grpc", "gateways_http"):
        sessions = {name: int(row["stot"]) for name, row in _servers(socket_path, backend).items()}
        print(f"{backend}: sessions per gateway {sessions}")
        assert len(sessions) == GATEWAYS and all(count > 0 for count in sessions.values()), (
            backend,
            sessions,
        )

    # And every gateway answered requests itself (its counters, by replica, in the metrics service).
    metrics_url = f"http://{suite.settings.metrics.http_host}:{suite.settings.metrics.http_port}/metrics"
    expected = 3 * CONNECTIONS + 3 * GATEWAYS + 3 * CONNECTIONS  # gRPC + HTTP + edge requests
    deadline = time.monotonic() + 30
    counts = _ok_counts(metrics_url)
    while time.monotonic() < deadline and not (len(counts) == GATEWAYS and sum(counts.values()) >= expected):
        time.sleep(0.5)
        counts = _ok_counts(metrics_url)
    print(f"ok replies per gateway (metrics service): {counts}")
    assert len(counts) == GATEWAYS and all(count > 0 for count in counts.values()), counts
    # Every request answered ok, each counted once (health probes are not requests).
    assert sum(counts.values()) == expected, counts
