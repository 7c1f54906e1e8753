"""bench/chaos.py's scenarios: each breaks the running suite one way and says what it did
(`Outcome`); `_scenarios()` lists them in the order they run."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from _chaos_suite import PROCESS_MARKERS, Background, RunningUp

from loadmaster.common import internal_auth
from loadmaster.common.ports import free_port
from loadmaster.v1 import (
    model_pool_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)


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
        scheduler_pb2.WorkerSessionRequest(
            hello=scheduler_pb2.WorkerHello(
                worker_id="chaos-fake-worker",
                data_endpoint=f"tcp://127.0.0.1:{port}",
                grpc_endpoint=f"127.0.0.1:{free_port()}",
                node=up.settings.model_pool.node,
                repository=["double"],
            )
        ),
        scheduler_pb2.WorkerSessionRequest(report=scheduler_pb2.WorkerReport(models=[slot], free_mb=1000)),
    ]
    stop = threading.Event()

    def outgoing() -> Iterator[scheduler_pb2.WorkerSessionRequest]:
        yield from messages
        while not stop.wait(1.0):
            yield messages[1]

    channel = grpc.insecure_channel(up.settings.scheduler.address)  # no credentials: the intruder
    observer = internal_auth.sync_channel(up.settings.scheduler.address)  # the suite's view
    stream = scheduler_pb2_grpc.SchedulerServiceStub(channel).WorkerSession(outgoing())
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
                workers = scheduler_pb2_grpc.SchedulerServiceStub(observer).ListWorkers(
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
