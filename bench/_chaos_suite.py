"""bench/chaos.py's running suite and what watches it: `loadmaster up` under test
(`RunningUp`), the background Inferential clients (`Background`) and the auditor of the
gpu-broker's promised memory (`Auditor`, `Sample`)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
from _harness import EXAMPLE_CONFIG

from loadmaster.cli.launcher import free_port_overrides, to_env
from loadmaster.cli.run_state import read_run_state, run_state_path
from loadmaster.common import internal_auth
from loadmaster.common.config import load_settings
from loadmaster.common.credentials import Identity
from loadmaster.v1 import (
    gpu_broker_pb2,
    gpu_broker_pb2_grpc,
    model_pool_pb2,
    model_pool_pb2_grpc,
)

RATE_HZ = 200.0
CLIENTS = 2
REPLY_GRACE_S = 12.0  # after the last request, how long stragglers may still be answered

PROCESS_MARKERS = {
    "gateway": "loadmaster.gateway",
    "scheduler": "loadmaster.scheduler",
    "worker": "loadmaster.model_pool",
    "broker": "loadmaster.gpu_broker",
    "metrics": "loadmaster.metrics",
    "redis": "redis-server",
}


# ---- background traffic (stock Inferential clients, one process each) --------------------


def _background_client(
    edge: str, client_id: str, rate_hz: float, stop: Any, marks: Any, slot: int, out: Any
) -> None:
    """`marks[slot]`: when the latest request answered OK was sent; `marks[CLIENTS + slot]`:
    when the latest one answered with an error was sent (wall clock)."""
    from inferential import Connection

    conn = Connection(server=edge, client_id=client_id)
    model = conn.model("double")
    sent: dict[str, float] = {}
    replies: dict[str, tuple[float, str]] = {}
    seq = 0
    next_send = time.time()

    def take(result: dict[str, Any] | None) -> None:
        while result is not None:
            rid = str(result.get("request_id") or result.get("response_id") or "")
            if rid in sent and rid not in replies:
                code = str(result.get("error_code", "ok"))
                replies[rid] = (time.time(), code)
                index = slot if code == "ok" else CLIENTS + slot
                if sent[rid] > marks[index]:
                    marks[index] = sent[rid]
            result = model.get_result(timeout_ms=0)

    while not stop.is_set():
        now = time.time()
        if now >= next_send:
            rid = f"{client_id}:{seq}"
            sent[rid] = now
            model.observe(x=np.array([seq], dtype=np.float32), request_id=rid)
            seq += 1
            next_send = max(next_send + 1.0 / rate_hz, now - 1.0)
        wait_ms = max(0, int((next_send - time.time()) * 1000))
        take(model.get_result(timeout_ms=wait_ms))
    until = time.time() + REPLY_GRACE_S
    while time.time() < until and len(replies) < len(sent):
        take(model.get_result(timeout_ms=100))
    conn.close()
    out.put(
        [
            (rid, at, *(replies.get(rid) or (float("nan"), "none")))  # (id, sent, replied, code)
            for rid, at in sent.items()
        ]
    )


@dataclass
class Background:
    edge: str
    context: Any = field(default_factory=lambda: mp.get_context("spawn"))
    processes: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stop = self.context.Event()
        self.marks = self.context.Array("d", 2 * CLIENTS)
        self.out = self.context.Queue()
        self.client_ids = [f"chaos-bg-{i}" for i in range(CLIENTS)]

    def start(self) -> None:
        for slot, client_id in enumerate(self.client_ids):
            process = self.context.Process(
                target=_background_client,
                args=(self.edge, client_id, RATE_HZ / CLIENTS, self.stop, self.marks, slot, self.out),
                daemon=True,
            )
            process.start()
            self.processes.append(process)

    def served_since(self, wall: float) -> bool:
        """Every client has had an OK reply to a request sent after `wall` and after its latest
        error reply (requests lost without any reply cannot be seen until the end)."""
        return all(self.marks[i] > max(wall, self.marks[CLIENTS + i]) for i in range(CLIENTS))

    def finish(self) -> list[tuple[str, float, float, str]]:
        self.stop.set()
        records: list[tuple[str, float, float, str]] = []
        for _ in self.processes:
            with contextlib.suppress(Exception):
                records += self.out.get(timeout=REPLY_GRACE_S + 30)
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()
        return records


# ---- the suite under test -----------------------------------------------------------------


@dataclass
class RunningUp:
    """`loadmaster up` as a child process group, on free ports."""

    log_path: Path
    overrides: dict[str, Any] = field(default_factory=free_port_overrides)
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.overrides["model_pool"]["preload"] = ["double", "echo"]
        self.env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "LOADMASTER_REDIS_URL")}
        self.env.update(to_env(self.overrides))
        for key, value in self.env.items():  # load_settings below reads the same addresses
            os.environ[key] = value
        self.settings = load_settings(EXAMPLE_CONFIG)
        # `up` signs every internal call with the secret it keeps next to the config: make it now
        # (up reuses it), so the auditor's calls carry it; the trust scenarios' calls never do.
        internal_auth.ensure_run_secrets(EXAMPLE_CONFIG.parent)
        internal_auth.setup_client(self.settings, Identity("chaos", f"auditor-{os.getpid()}"))

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "loadmaster.cli.main", "up", "--config", str(EXAMPLE_CONFIG)],
                env={**self.env, "COLUMNS": "160"},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def find(self, marker: str) -> psutil.Process | None:
        if self.process is None:
            return None
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.process.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    if marker in " ".join(child.cmdline()):
                        return child
        return None

    @property
    def edge(self) -> str:
        return self.settings.gateway.edge.bind

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.settings.gateway.http_port}"

    def redis_url(self) -> str:
        return str(read_run_state(run_state_path(self.settings.gateway.address)).get("redis_url") or "")


def _infer_double(http: str) -> bool:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(http, connection_timeout=2.0, network_timeout=5.0)
    try:
        tensor = triton.InferInput("x", [2], "FP32")
        tensor.set_data_from_numpy(np.ones(2, dtype=np.float32))
        return bool(np.array_equal(client.infer("double", [tensor]).as_numpy("x"), np.full(2, 2.0)))
    except Exception:
        return False
    finally:
        client.close()


# ---- the auditor: gateway RSS and promised memory, sampled all run long ---------------------


@dataclass
class Sample:
    t: float
    gateway_pid: int | None
    gateway_rss_mb: float | None
    promised_mb: float | None
    capacity_mb: float | None


class Auditor(threading.Thread):
    def __init__(self, up: RunningUp, period_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.up = up
        self.period_s = period_s
        self.samples: list[Sample] = []
        self.capacity_mb: float | None = None
        self.halt = threading.Event()
        self._gateway: psutil.Process | None = None

    def run(self) -> None:
        broker = internal_auth.sync_channel(self.up.settings.gpu_broker.address)
        worker = internal_auth.sync_channel(self.up.settings.model_pool.address)
        broker_stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(broker)
        worker_stub = model_pool_pb2_grpc.ModelPoolServiceStub(worker)
        while not self.halt.wait(self.period_s):
            self.samples.append(Sample(time.time(), *self._rss(), *self._promised(broker_stub, worker_stub)))
        broker.close()
        worker.close()

    def _rss(self) -> tuple[int | None, float | None]:
        try:
            if self._gateway is None or not self._gateway.is_running():
                self._gateway = self.up.find(PROCESS_MARKERS["gateway"])
            if self._gateway is None:
                return None, None
            return self._gateway.pid, self._gateway.memory_info().rss / 2**20
        except psutil.Error:
            self._gateway = None
            return None, None

    def _promised(
        self,
        broker: gpu_broker_pb2_grpc.GpuBrokerServiceStub,
        worker: model_pool_pb2_grpc.ModelPoolServiceStub,
    ) -> tuple[float | None, float | None]:
        """Per GPU (the example has one): MB under live leases, plus MB a worker still holds
        for a model whose lease is gone; the worst GPU's figure and its capacity."""
        try:
            gpus = broker.Inventory(gpu_broker_pb2.InventoryRequest(), timeout=1).gpus
            leases = broker.ListLeases(gpu_broker_pb2.ListLeasesRequest(), timeout=1).leases
        except grpc.RpcError:
            return None, None
        capacity = {(g.node, g.index): float(g.total_mb) for g in gpus}
        if capacity and self.capacity_mb is None:
            self.capacity_mb = max(capacity.values())
        promised: dict[tuple[str, int], float] = {}
        for lease in leases:
            for index, mb in lease.mb_per_gpu.items():
                promised[(lease.node, index)] = promised.get((lease.node, index), 0.0) + mb
        live = {lease.lease_id for lease in leases}
        with contextlib.suppress(grpc.RpcError):
            status = worker.Status(model_pool_pb2.StatusRequest(), timeout=1)
            node = self.up.settings.model_pool.node
            for m in status.models:
                if m.state == model_pool_pb2.MODEL_STATE_IDLE or (m.lease_id and m.lease_id in live):
                    continue
                for index, mb in m.mb_per_gpu.items():  # held without a live lease
                    promised[(node, index)] = promised.get((node, index), 0.0) + mb
        if not promised:
            return 0.0, self.capacity_mb
        # After a FLUSHALL the inventory may be gone: judge against the capacity first seen.
        worst = max(promised, key=lambda key: promised[key] - capacity.get(key, self.capacity_mb or 0))
        return promised[worst], capacity.get(worst, self.capacity_mb)


# ---- scenarios -----------------------------------------------------------------------------
