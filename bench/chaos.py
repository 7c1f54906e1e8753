"""`make chaos`: break a running suite in every way issue 25 lists, under background traffic,
and record what each break cost.

    python bench/chaos.py                 # the whole run (bounded: about 5 minutes)
    python bench/chaos.py --only kill-worker,flushall

It starts `loadmaster up` (the real supervisor) with the example config on free ports,
preloading `double` and `echo`, and runs stock Inferential clients in their own processes
sending `double` at 200 req/s in all (each request tagged with a `request_id`, so every
reply, error replies too, is matched to its request). Then, one after another:

- kill -9 each process: gateway, scheduler, worker (model-pool), gpu-broker, metrics,
  redis-server (the supervisor restarts it);
- FLUSHALL the embedded Redis; restart Redis (SIGTERM: it exits, the supervisor restarts it);
- a maximum-size request: BYTES to `echo` just under `gateway.limits.max_payload_bytes`, over
  HTTP with tritonclient, binary and JSON;
- an edge client that sends 256 KB requests and never reads its replies;
- a fake worker: a `WorkerSession` with no credentials that registers `double` and listens on
  its own data port (does the scheduler send it clients' requests?);
- an impostor: a DEALER that connects with a background client's identity, sends one request
  and leaves (is the real client still served afterwards?).

For each scenario: background requests sent during it and never answered (the target is 0),
seconds from the fault until a request sent after it is answered OK, the worst background
latency, the gateway's resident-memory growth, and whether the memory the gpu-broker has
promised (its leases, plus memory a worker still holds for a lease that is gone) ever exceeded
a GPU's capacity (polled every 0.25 s). A scenario that cannot be run or does not recover is
reported as such, and the run goes on. Writes bench/results/chaos.json and bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
from _harness import EXAMPLE_CONFIG, write_result

from loadmaster.cli.launcher import free_port_overrides, to_env
from loadmaster.cli.run_state import read_run_state, run_state_path
from loadmaster.common import internal_auth
from loadmaster.common.config import load_settings
from loadmaster.common.ports import free_port
from loadmaster.v1 import (
    gpu_broker_pb2,
    gpu_broker_pb2_grpc,
    model_pool_pb2,
    model_pool_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

RATE_HZ = 200.0
CLIENTS = 2
RECOVER_TIMEOUT_S = 12.0  # a scenario not serving again by then is reported as not recovered
OBSERVE_FAULT_S = 6.0  # a fault's window lasts at least this long (lease renewals come every 5 s)
SETTLE_S = 2.0
REPLY_GRACE_S = 12.0  # after the last request, how long stragglers may still be answered
RUN_BUDGET_S = 330.0  # scenarios not started by then are reported as skipped
TARGET_RECOVER_S = 5.0
TARGET_WORST_MS = 100.0

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
        internal_auth.setup_client(self.settings, internal_auth.Identity("chaos", f"auditor-{os.getpid()}"))

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
        broker_stub = gpu_broker_pb2_grpc.GpuBrokerStub(broker)
        worker_stub = model_pool_pb2_grpc.ModelPoolStub(worker)
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
        self, broker: gpu_broker_pb2_grpc.GpuBrokerStub, worker: model_pool_pb2_grpc.ModelPoolStub
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


@dataclass
class Outcome:
    """What a scenario's action reports besides the common measurements."""

    detail: str = ""
    refused: bool | None = None  # trust scenarios: was the bad caller refused?
    extra: dict[str, Any] = field(default_factory=dict)


def _kill(up: RunningUp, name: str, sig: int = signal.SIGKILL) -> Outcome:
    victim = up.find(PROCESS_MARKERS[name])
    if victim is None:
        return Outcome(detail=f"no {name} process found")
    victim.send_signal(sig)
    return Outcome(detail=f"pid {victim.pid} sent {signal.Signals(sig).name}")


def _flushall(up: RunningUp) -> Outcome:
    import redis

    url = up.redis_url()
    if not url:
        return Outcome(detail="no Redis URL in the run state")
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        client.flushall()
    finally:
        client.close()
    return Outcome(detail="FLUSHALL")


def _max_size(up: RunningUp, *, binary: bool) -> Outcome:
    """BYTES to `echo`, its raw size just under the payload limit, by tritonclient over HTTP."""
    import tritonclient.http as triton

    limit = up.settings.gateway.limits.max_payload_bytes
    element = 1020  # + 4-byte length prefix: 1 KiB per element
    count = (limit - (64 << 10)) // (element + 4)
    array = np.full(count, b"a" * element, dtype=object)
    client = triton.InferenceServerClient(up.http, connection_timeout=10.0, network_timeout=120.0)
    started = time.monotonic()
    try:
        tensor = triton.InferInput("text", [count], "BYTES")
        tensor.set_data_from_numpy(array, binary_data=binary)
        output = triton.InferRequestedOutput("text", binary_data=binary)
        result = client.infer("echo", [tensor], outputs=[output], timeout=60_000_000)
        echoed = result.as_numpy("text")
        ok = echoed is not None and len(echoed) == count
        detail = f"answered {'OK' if ok else 'wrong'}"
    except Exception as error:  # the reply may be a refusal: record it
        detail = f"refused/failed: {str(error)[:160]}"
    finally:
        client.close()
    mib = count * (element + 4) / 2**20
    return Outcome(
        detail=f"{mib:.1f} MiB in {time.monotonic() - started:.1f} s: {detail}",
        extra={"payload_mib": round(mib, 1), "request_s": round(time.monotonic() - started, 2)},
    )


def _non_reader(up: RunningUp, *, requests: int = 2000, budget_s: float = 8.0) -> Outcome:
    """A stock client that sends 256 KB requests and never reads a reply."""
    import zmq
    from inferential import Connection

    conn = Connection(server=up.edge, client_id="chaos-nonreader")
    conn._socket.setsockopt(zmq.SNDTIMEO, 500)  # never let a full queue block this process
    model = conn.model("double")
    x = np.zeros(64 << 10, dtype=np.float32)  # 256 KB
    sent = 0
    deadline = time.monotonic() + budget_s
    while sent < requests and time.monotonic() < deadline:
        try:
            model.observe(x=x)
            sent += 1
        except zmq.Again:
            continue
    time.sleep(2.0)  # let the gateway try to deliver what it has
    conn.close()
    return Outcome(detail=f"sent {sent} x 256 KB, read none", extra={"sent": sent})


def _fake_worker(up: RunningUp, *, listen_s: float = 4.0) -> Outcome:
    """Register `double` with the scheduler without credentials and count clients' requests
    that arrive at the fake worker's data port."""
    import zmq

    context = zmq.Context()
    data = context.socket(zmq.ROUTER)
    port = free_port()
    data.bind(f"tcp://127.0.0.1:{port}")
    slot = model_pool_pb2.ModelSlotStatus(
        model_id="double", state=model_pool_pb2.MODEL_STATE_READY, generation=1, max_inflight=64, vram_mb=16
    )
    messages = [
        scheduler_pb2.WorkerMessage(
            hello=scheduler_pb2.WorkerHello(
                worker_id="chaos-fake-worker",
                data_endpoint=f"tcp://127.0.0.1:{port}",
                grpc_endpoint=f"127.0.0.1:{free_port()}",
                node=up.settings.model_pool.node,
                repository=["double"],
            )
        ),
        scheduler_pb2.WorkerMessage(report=scheduler_pb2.WorkerReport(models=[slot], free_mb=1000)),
    ]
    stop = threading.Event()

    def outgoing() -> Iterator[scheduler_pb2.WorkerMessage]:
        yield from messages
        while not stop.wait(1.0):
            yield messages[1]

    channel = grpc.insecure_channel(up.settings.scheduler.address)  # no credentials: the intruder
    observer = internal_auth.sync_channel(up.settings.scheduler.address)  # the suite's view
    stream = scheduler_pb2_grpc.SchedulerStub(channel).WorkerSession(outgoing())
    refused_with = ""

    def drain() -> None:
        nonlocal refused_with
        try:
            for _ in stream:
                pass
        except grpc.RpcError as error:
            if error.code() is not grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                refused_with = error.code().name  # type: ignore[attr-defined]

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    received = 0
    registered = False
    deadline = time.monotonic() + listen_s
    while time.monotonic() < deadline:
        if data.poll(100):
            data.recv_multipart()
            received += 1
        if not registered:
            with contextlib.suppress(grpc.RpcError):
                workers = scheduler_pb2_grpc.SchedulerStub(observer).ListWorkers(
                    scheduler_pb2.ListWorkersRequest(), timeout=1
                )
                registered = any(w.worker_id == "chaos-fake-worker" for w in workers.workers)
    stop.set()
    stream.cancel()
    reader.join(2)
    channel.close()
    observer.close()
    data.close(0)
    context.term()
    refused = not registered and received == 0
    return Outcome(
        detail=(
            f"registered={registered}, clients' requests received={received}"
            + (f", stream ended {refused_with}" if refused_with else "")
        ),
        refused=refused,
        extra={"registered": registered, "requests_received": received},
    )


def _impostor(up: RunningUp, *, run_s: float = 8.0, rate_hz: float = 20.0) -> Outcome:
    """A victim (a stock client of its own) sends `double` at `rate_hz`; 2 s in, a DEALER with
    the victim's identity connects, sends one request and leaves after 1 s. Refused when every
    request the victim sends after the impostor has left is answered."""
    import zmq
    from inferential import Connection

    victim_id = f"chaos-victim-{os.getpid()}"
    left_at: list[float] = []

    def impostor() -> None:
        conn = Connection(server=up.edge, client_id=victim_id)  # the stock client: identity = id
        conn.model("double").observe(x=np.zeros(1, dtype=np.float32), request_id="impostor")
        time.sleep(1.0)
        conn._socket.setsockopt(zmq.LINGER, 0)
        conn.close()
        left_at.append(time.time())

    conn = Connection(server=up.edge, client_id=victim_id)
    model = conn.model("double")
    sent: dict[str, float] = {}
    answered: dict[str, str] = {}
    began = time.time()
    thread = threading.Thread(target=impostor, daemon=True)
    seq = 0
    while time.time() - began < run_s + 3.0:
        if time.time() - began < run_s:
            rid = f"victim:{seq}"
            sent[rid] = time.time()
            model.observe(x=np.array([seq], dtype=np.float32), request_id=rid)
            seq += 1
        if seq == int(2 * rate_hz) and not thread.is_alive() and not left_at:
            thread.start()
        result = model.get_result(timeout_ms=int(1000 / rate_hz))
        while result is not None:
            answered[str(result.get("request_id", ""))] = str(result.get("error_code", "ok"))
            result = model.get_result(timeout_ms=0)
    thread.join(5)
    conn._socket.setsockopt(zmq.LINGER, 0)
    conn.close()
    after = [rid for rid, at in sent.items() if left_at and at > left_at[0] + 0.5]
    lost = [rid for rid in after if rid not in answered]
    ok = [rid for rid in after if answered.get(rid) == "ok"]
    return Outcome(
        detail=(
            f"victim sent {len(sent)}; after the impostor left: {len(after)} sent, {len(ok)} OK, "
            f"{len(lost)} never answered"
        ),
        refused=bool(after) and not lost and bool(ok),
        extra={"victim_lost_after": len(lost)},
    )


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    action: Callable[[RunningUp, Background], Outcome]
    kind: str  # fault | load | trust


def _scenarios() -> list[Scenario]:
    kills = [
        Scenario(f"kill-{name}", lambda up, bg, name=name: _kill(up, name), "fault")
        for name in ("gateway", "scheduler", "worker", "broker", "metrics", "redis")
    ]
    return [
        *kills,
        Scenario("restart-redis", lambda up, bg: _kill(up, "redis", signal.SIGTERM), "fault"),
        Scenario("max-size-binary", lambda up, bg: _max_size(up, binary=True), "load"),
        Scenario("max-size-json", lambda up, bg: _max_size(up, binary=False), "load"),
        Scenario("non-reading-client", lambda up, bg: _non_reader(up), "load"),
        Scenario("fake-worker", lambda up, bg: _fake_worker(up), "trust"),
        Scenario("impostor-identity", lambda up, bg: _impostor(up), "trust"),
        # Last: without re-registration a flushed Redis is an outage that outlasts the run.
        Scenario("flushall", lambda up, bg: _flushall(up), "fault"),
    ]


# ---- measuring -------------------------------------------------------------------------------


@dataclass
class Window:
    scenario: Scenario
    start: float
    fault: float
    end: float = 0.0
    outcome: Outcome = field(default_factory=Outcome)
    recovered: bool = False
    supervisor_alive: bool = True


def _measure(
    window: Window, records: list[tuple[str, float, float, str]], samples: list[Sample]
) -> dict[str, Any]:
    mine = [r for r in records if window.start <= r[1] < window.end]
    unanswered = [r for r in mine if np.isnan(r[2])]
    answered = [r for r in mine if not np.isnan(r[2])]
    errors: dict[str, int] = {}
    for r in answered:
        if r[3] != "ok":
            errors[r[3]] = errors.get(r[3], 0) + 1
    # Serving again: the first OK reply to a request sent after the last failed one (an error
    # reply or none at all) among those sent since the fault.
    since = [r for r in mine if r[1] >= window.fault]
    failed = [r[1] for r in since if np.isnan(r[2]) or r[3] != "ok"]
    after_failures = max(failed, default=window.fault)
    ok_after = sorted(r[2] for r in since if r[1] >= after_failures and r[3] == "ok" and not np.isnan(r[2]))
    recovered_s = round(ok_after[0] - window.fault, 3) if ok_after else None
    worst_ms = round(max((r[2] - r[1] for r in answered), default=0.0) * 1000, 1)
    growth: float | None = None
    in_window = [s for s in samples if window.start <= s.t < window.end and s.gateway_rss_mb is not None]
    by_pid: dict[int, list[float]] = {}
    for s in in_window:
        by_pid.setdefault(s.gateway_pid or 0, []).append(s.gateway_rss_mb or 0.0)
    if by_pid:
        growth = round(max(max(v) - v[0] for v in by_pid.values()), 1)
    audited = [s for s in samples if window.start <= s.t < window.end and s.promised_mb is not None]
    over = [s for s in audited if s.capacity_mb and (s.promised_mb or 0) > s.capacity_mb]
    return {
        "scenario": window.scenario.name,
        "kind": window.scenario.kind,
        "detail": window.outcome.detail,
        "sent": len(mine),
        "unanswered": len(unanswered),
        "error_replies": errors,
        "recovered_s": recovered_s,
        "recovered_within_timeout": window.recovered,
        "worst_latency_ms": worst_ms,
        "gateway_rss_growth_mb": growth,
        "promised_over_capacity": bool(over),
        "max_promised_mb": max((s.promised_mb or 0.0 for s in audited), default=None),
        "audit_samples": len(audited),
        "refused": window.outcome.refused,
        "supervisor_alive": window.supervisor_alive,
        **window.outcome.extra,
    }


def _targets(rows: list[dict[str, Any]], payload_limit_mb: float) -> list[dict[str, Any]]:
    ran = [r for r in rows if "skipped" not in r]
    faults = [r for r in ran if r["kind"] == "fault"]
    slowest = max(
        faults, key=lambda r: r["recovered_s"] if r["recovered_s"] is not None else float("inf"), default=None
    )
    worst_recover = None if slowest is None else slowest["recovered_s"]
    if slowest is None:
        recover_text = "-"
    elif worst_recover is None:
        recover_text = f"never ({slowest['scenario']})"
    else:
        recover_text = f"{worst_recover} s ({slowest['scenario']})"
    big = [r for r in ran if r["scenario"].startswith("max-size")]
    memory = [r for r in ran if r["kind"] == "load" and r["gateway_rss_growth_mb"] is not None]
    trust = [r for r in ran if r["kind"] == "trust"]
    unanswered = sum(r["unanswered"] for r in ran)
    targets = [
        {"name": "requests without a reply, all scenarios", "measured": unanswered, "target": 0,
         "unit": "", "met": unanswered == 0},
        {"name": "serving again after each fault (worst)",
         "measured": recover_text,
         "target": f"<= {TARGET_RECOVER_S:g} s", "unit": "",
         "met": worst_recover is not None and worst_recover <= TARGET_RECOVER_S},
        {"name": "promised memory over capacity (audited)",
         "measured": sum(r["promised_over_capacity"] for r in ran), "target": 0, "unit": "scenarios",
         "met": not any(r["promised_over_capacity"] for r in ran)},
    ]  # fmt: skip
    if big:
        worst = max(r["worst_latency_ms"] for r in big)
        targets.append({"name": "background worst latency during a max-size request", "measured": worst,
                        "target": f"<= {TARGET_WORST_MS:g}", "unit": "ms", "met": worst <= TARGET_WORST_MS})  # fmt: skip
    if memory:
        growth = max(r["gateway_rss_growth_mb"] for r in memory)
        targets.append({"name": "gateway RSS growth in memory scenarios", "measured": growth,
                        "target": f"< {2 * payload_limit_mb:g}", "unit": "MB",
                        "met": growth < 2 * payload_limit_mb})  # fmt: skip
    if trust:
        refused = sum(1 for r in trust if r["refused"])
        targets.append({"name": "internal-trust scenarios refused", "measured": f"{refused}/{len(trust)}",
                        "target": f"{len(trust)}/{len(trust)}", "unit": "", "met": refused == len(trust)})  # fmt: skip
    return targets


# ---- the run -----------------------------------------------------------------------------------


def run(only: set[str] | None, log_dir: Path) -> dict[str, Any]:
    began = time.monotonic()
    up = RunningUp(log_dir / "up.log")
    print(f"starting loadmaster up (log: {up.log_path})…", flush=True)
    up.start()
    deadline = time.monotonic() + 180
    while not _infer_double(up.http):
        if not up.alive or time.monotonic() > deadline:
            up.stop()
            raise SystemExit(f"the suite did not start; see {up.log_path}")
        time.sleep(0.5)
    print(f"suite serving after {time.monotonic() - began:.1f} s", flush=True)
    auditor = Auditor(up)
    auditor.start()
    background = Background(up.edge)
    background.start()
    while not background.served_since(0.0):  # both clients warmed up
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    windows: list[Window] = []
    skipped: list[str] = []
    baseline = Window(Scenario("baseline", lambda up, bg: Outcome(), "load"), time.time(), time.time())
    time.sleep(3.0)
    baseline.end = time.time()
    baseline.recovered = True
    windows.append(baseline)
    for scenario in _scenarios():
        if only and scenario.name not in only:
            continue
        if time.monotonic() - began > RUN_BUDGET_S:
            skipped.append(scenario.name)
            continue
        print(f"-- {scenario.name}", flush=True)
        window = Window(scenario, start=windows[-1].end, fault=time.time())
        try:
            window.outcome = scenario.action(up, background)
        except Exception as error:  # a scenario that cannot run is reported, not fatal
            window.outcome = Outcome(detail=f"could not run: {type(error).__name__}: {error}"[:200])
        acted = time.time()
        if scenario.kind == "fault":
            time.sleep(max(0.0, window.fault + OBSERVE_FAULT_S - time.time()))
        wait_until = time.monotonic() + RECOVER_TIMEOUT_S
        while time.monotonic() < wait_until and not background.served_since(acted):
            time.sleep(0.05)
        window.recovered = background.served_since(acted)
        time.sleep(SETTLE_S)
        window.supervisor_alive = up.alive
        window.end = time.time()
        windows.append(window)
        print(f"   {window.outcome.detail}; serving again: {window.recovered}", flush=True)
        if not up.alive:
            print("   loadmaster up has exited: the remaining scenarios are skipped", flush=True)
            break
    records = background.finish()
    auditor.halt.set()
    auditor.join(5)
    code = up.stop()
    rows = [_measure(w, records, auditor.samples) for w in windows]
    ran = {w.scenario.name for w in windows}
    skipped += [
        s.name
        for s in _scenarios()
        if s.name not in ran and s.name not in skipped and (not only or s.name in only)
    ]
    rows += [
        {"scenario": name, "kind": "-", "skipped": "run budget spent or loadmaster up exited"}
        for name in skipped
    ]
    payload_limit_mb = up.settings.gateway.limits.max_payload_bytes / 2**20
    return {
        "rate_hz": RATE_HZ,
        "clients": CLIENTS,
        "duration_s": round(time.monotonic() - began, 1),
        "up_exit_code": code,
        "requests": len(records),
        "scenarios": rows,
        "targets": _targets([r for r in rows if r["scenario"] != "baseline"], payload_limit_mb),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated scenario names (default: all)")
    parser.add_argument("--logs", type=Path, help="folder for the suite's log (default: a temp folder)")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    import tempfile

    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="loadmaster-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result = run(only, log_dir)
    path = write_result("chaos", result)
    print(json.dumps(result["targets"], indent=2))
    print(f"wrote {path}")
    import report

    report.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
