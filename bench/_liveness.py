"""A worker that vanishes without a goodbye, under load (issue 33): the shared harness of
bench/worker_freeze.py and tests/e2e/faults/test_worker_freeze.py.

A suite with two model-pool workers serves `double` to stock clients on the tensor front ends
(the edge: `inferential`; KServe v2 over HTTP and gRPC: `tritonclient`), each client sending on
a fixed cadence and waiting for each reply up to `NO_REPLY_S`; optionally a streamed `tiny-chat`
generation (`openai`) runs on the second worker. Then that worker's process group is frozen
with SIGSTOP: its sockets stay open and its kernel keeps acknowledging TCP, as for a hung host
or a vanished container, so only unanswered probes can find it (docs/liveness.md).

What each front end saw, counted from the freeze: requests without a reply (none expected),
error replies by code, the first good reply, and `recovered_s`, when the last request the
freeze held up (an error, or a reply slower than `HELD_UP_S`) was answered.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import numpy as np

from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

__all__ = [
    "FRONT_END_NAMES",
    "HELD_UP_S",
    "NO_REPLY",
    "NO_REPLY_S",
    "FrontEndLoad",
    "StreamWatch",
    "data_endpoint_of",
    "freeze",
    "front_ends",
    "load_model_on",
    "summarize",
    "thaw",
    "wait_for_workers",
    "watch_scheduler_drop",
]

FRONT_END_NAMES = ("edge", "kserve_http", "kserve_grpc")
NO_REPLY = "no reply"
NO_REPLY_S = 5.0  # how long a client waits for a reply before counting the request unanswered
HELD_UP_S = 0.5  # a reply this much slower than usual was held up by the freeze
X = np.arange(4, dtype=np.float32)


class Caller(Protocol):
    def call(self) -> str:
        """One `double` request: "" when answered with a result, else the error code or NO_REPLY."""

    def close(self) -> None: ...


class EdgeCaller:
    """The stock `inferential` client (one outstanding observation, as a robot's loop)."""

    def __init__(self, edge: str) -> None:
        self._edge = edge
        self._open()

    def _open(self) -> None:
        from inferential import Connection

        self._conn = Connection(server=self._edge, client_id=f"freeze-{uuid.uuid4().hex[:8]}")
        self._model = self._conn.model("double")

    def call(self) -> str:
        self._model.observe(x=X)
        result = self._model.get_result(timeout_ms=int(NO_REPLY_S * 1000))
        if result is None:  # a late reply would be taken for the next request's: start afresh
            self._conn.close()
            self._open()
            return NO_REPLY
        return str(result.get("error_code", "error")) if "error" in result else ""

    def close(self) -> None:
        self._conn.close()


class HttpCaller:
    """`tritonclient.http` (KServe v2 over HTTP)."""

    def __init__(self, address: str) -> None:
        import tritonclient.http as triton_http

        self._triton = triton_http
        self._client = triton_http.InferenceServerClient(
            address, connection_timeout=NO_REPLY_S, network_timeout=NO_REPLY_S
        )

    def call(self) -> str:
        from tritonclient.utils import InferenceServerException

        tensor = self._triton.InferInput("x", [len(X)], "FP32")
        tensor.set_data_from_numpy(X)
        started = time.monotonic()
        try:
            self._client.infer("double", [tensor])
        except InferenceServerException as error:
            return f"http {error.status()}"
        except Exception:  # the client's own timeout (geventhttpclient raises its own types)
            if time.monotonic() - started >= NO_REPLY_S - 0.1:
                return NO_REPLY
            raise
        return ""

    def close(self) -> None:
        self._client.close()


class GrpcCaller:
    """`tritonclient.grpc` (KServe v2 over gRPC)."""

    def __init__(self, address: str) -> None:
        import tritonclient.grpc as triton_grpc

        self._triton = triton_grpc
        self._client = triton_grpc.InferenceServerClient(address)

    def call(self) -> str:
        from tritonclient.utils import InferenceServerException

        tensor = self._triton.InferInput("x", [len(X)], "FP32")
        tensor.set_data_from_numpy(X)
        try:
            self._client.infer("double", [tensor], client_timeout=NO_REPLY_S)
        except InferenceServerException as error:
            status = str(error.status())
            return NO_REPLY if "DEADLINE_EXCEEDED" in status else status
        return ""

    def close(self) -> None:
        self._client.close()


def front_ends(suite: Any) -> dict[str, Callable[[], Caller]]:
    """Each tensor front end of `suite` (a launcher `Suite`): a factory of stock clients."""
    gateway = suite.settings.gateway
    return {
        "edge": lambda: EdgeCaller(gateway.edge.bind),
        "kserve_http": lambda: HttpCaller(f"{gateway.http_host}:{gateway.http_port}"),
        "kserve_grpc": lambda: GrpcCaller(gateway.address),
    }


@dataclass(slots=True)
class Call:
    sent: float  # time.monotonic()
    done: float
    code: str  # "" ok, an error code, or NO_REPLY


class _Client(threading.Thread):
    """One stock client sending on a fixed cadence (never more than one request out)."""

    def __init__(self, make: Callable[[], Caller], period_s: float, stop: threading.Event, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._make = make
        self._period_s = period_s
        self._stop_sending = stop
        self.calls: list[Call] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            caller = self._make()
        except BaseException as error:  # reported by FrontEndLoad.stop
            self.failure = error
            return
        try:
            next_at = time.monotonic()
            while not self._stop_sending.is_set():
                delay = next_at - time.monotonic()
                if delay > 0 and self._stop_sending.wait(delay):
                    break
                next_at = max(next_at + self._period_s, time.monotonic() - self._period_s)
                sent = time.monotonic()
                code = caller.call()
                self.calls.append(Call(sent, time.monotonic(), code))
        except BaseException as error:
            self.failure = error
        finally:
            caller.close()


class FrontEndLoad:
    """`clients` stock clients of one front end, `rate_hz` requests per second among them."""

    def __init__(self, name: str, make: Callable[[], Caller], *, rate_hz: float, clients: int) -> None:
        self.name = name
        self._stop = threading.Event()
        period = clients / rate_hz
        self._clients = [_Client(make, period, self._stop, f"{name}-{i}") for i in range(clients)]

    def start(self) -> None:
        for client in self._clients:
            client.start()
            time.sleep(0.002)  # spread their cadences a little

    def stop(self) -> list[Call]:
        """Stop sending, wait for the replies still out (at most NO_REPLY_S), return every call."""
        self._stop.set()
        for client in self._clients:
            client.join(NO_REPLY_S + 5)
        failures = [c.failure for c in self._clients if c.failure is not None]
        if failures:
            raise RuntimeError(f"{self.name}: a client failed: {failures[0]!r}") from failures[0]
        return sorted((call for c in self._clients for call in c.calls), key=lambda call: call.sent)


def summarize(calls: list[Call], frozen_at: float) -> dict[str, Any]:
    """What the calls saw, in seconds from `frozen_at`."""
    latencies = sorted(call.done - call.sent for call in calls if call.code == "")
    usual = latencies[len(latencies) // 2] if latencies else 0.0
    errors: dict[str, int] = {}
    for call in calls:
        if call.code and call.code != NO_REPLY:
            errors[call.code] = errors.get(call.code, 0) + 1
    good_after = [call.done for call in calls if call.code == "" and call.sent >= frozen_at]
    held_up = [
        call.done
        for call in calls
        if call.code != NO_REPLY
        and call.done >= frozen_at
        and (call.code != "" or call.done - call.sent > usual + HELD_UP_S)
    ]
    around = [call.done - call.sent for call in calls if call.done >= frozen_at - 1.0]
    span = (calls[-1].sent - calls[0].sent) if len(calls) > 1 else 0.0
    return {
        "sent": len(calls),
        "rate_hz": round(len(calls) / span, 1) if span else 0.0,
        "no_reply": sum(call.code == NO_REPLY for call in calls),
        "errors": errors,
        "held_up": len(held_up),
        "first_good_reply_s": round(min(good_after) - frozen_at, 3) if good_after else None,
        "recovered_s": round(max(held_up) - frozen_at, 3) if held_up else 0.0,
        "slowest_reply_s": round(max(around), 3) if around else None,
        "usual_reply_ms": round(usual * 1000, 2),
    }


@dataclass
class StreamWatch:
    """A streamed chat completion (the `openai` client) on `model`, in a thread of its own."""

    base_url: str
    model: str = "tiny-chat"
    max_tokens: int = 1500
    first_chunk: threading.Event = field(default_factory=threading.Event)
    chunks: int = 0
    ended_at: float | None = None
    outcome: str = ""  # "finished", "error event: ...", "timeout", "failed: ..."
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stream-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import openai

        client = openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=NO_REPLY_S)
        try:
            stream = client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": "tell me a long story"}],
                max_tokens=self.max_tokens,
                stream=True,
            )
            for _ in stream:
                self.chunks += 1
                self.first_chunk.set()
            self.outcome = "finished"
        except openai.APITimeoutError:
            self.outcome = "timeout"
        except openai.APIConnectionError as error:
            self.outcome = f"failed: {error!r}"
        except openai.APIError as error:  # what an SSE error event raises
            self.outcome = f"error event: {error.message}"
        finally:
            self.ended_at = time.monotonic()
            self.first_chunk.set()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)


def freeze(pid: int) -> float:
    """SIGSTOP the process group of `pid` (the service and any child it started)."""
    os.killpg(os.getpgid(pid), signal.SIGSTOP)
    return time.monotonic()


def thaw(pid: int) -> None:
    try:
        os.killpg(os.getpgid(pid), signal.SIGCONT)
    except ProcessLookupError:
        pass


def load_model_on(worker_address: str, model_id: str, *, timeout_s: float = 120.0) -> None:
    """Load `model_id` on one worker (ModelPool.Load), so the scheduler places it there."""
    with grpc.insecure_channel(worker_address) as channel:
        stub = model_pool_pb2_grpc.ModelPoolServiceStub(channel)
        stub.Load(model_pool_pb2.LoadRequest(model_id=model_id), timeout=timeout_s)


def data_endpoint_of(worker_address: str) -> str:
    """The data endpoint a worker advertises (ModelPool.Status)."""
    with grpc.insecure_channel(worker_address) as channel:
        stub = model_pool_pb2_grpc.ModelPoolServiceStub(channel)
        return str(stub.Status(model_pool_pb2.StatusRequest(), timeout=10).data_endpoint)


def _workers(scheduler: str) -> list[scheduler_pb2.WorkerInfo]:
    with grpc.insecure_channel(scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        return list(stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5).workers)


def wait_for_workers(scheduler: str, count: int, model_id: str, *, timeout_s: float = 60.0) -> None:
    """Until the scheduler lists `count` workers holding `model_id` READY."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = [
            w
            for w in _workers(scheduler)
            if any(m.model_id == model_id and m.state == model_pool_pb2.MODEL_STATE_READY for m in w.models)
        ]
        if len(ready) >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the scheduler lists {len(ready)} of {count} workers with {model_id} READY")
        time.sleep(0.2)


def watch_scheduler_drop(
    scheduler: str, data_endpoint: str, since: float, *, timeout_s: float = 10.0
) -> float | None:
    """Seconds from `since` until the scheduler no longer lists the worker at `data_endpoint`."""
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        if all(w.data_endpoint != data_endpoint for w in _workers(scheduler)):
            return round(time.monotonic() - since, 3)
        time.sleep(0.05)
    return None
