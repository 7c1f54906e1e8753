"""Dynamic batching gain: `policy` with N concurrent clients, batched vs unbatched.

    .venv/bin/python bench/model_pool_batching.py [--clients 8] [--seconds 5] [--model policy]

Starts the real suite twice on free ports (`loadmaster.cli.launcher.Suite`, the
example config, only the model preloaded): one with `max_batch_size` 1 (no batching)
and one with `max_batch_size` 8. N DEALER clients per suite drive its worker's real
ZMQ data port, each sending its next request as soon as the previous reply arrives
(closed loop). The two suites are measured in alternating windows (`--windows`, 5 of
each by default, `--seconds` in total per mode), so load that other work puts on the
machine drifts into both modes alike instead of into whichever ran second. Prints
requests/s, latency percentiles, the mean batch size the worker reported and the
worker process's CPU time per request (which moves much less than throughput when
other work shares the machine), then the same closed loops straight into
`ModelPool.infer` in this process (the pool core: batcher + engine threads, no
sockets; an unbatched and a batched pool, alternating the same way), and writes
bench/results/model_pool_batching.json (with the machine's load average). Targets: batched
>= 3x unbatched through the data port, and batched through the data port >= 0.9x the lean
reference batched (issue 20; printed, and `batched_share_of_lean` in the JSON).

A lean reference worker runs in the same alternating windows (for a TorchScript model with
one input and one output, like `policy`): one thread, one ROUTER socket, the worker's own
codec and artifact, batches formed the same way, the forward run inline, and nothing else.
Its two modes show what the socket, the codec and the model cost on their own: how much of
the worker's throughput its event loop, engine threads and bookkeeping take, and how much
batching can gain for this model once those are gone (`lean_reference_gain`).

The load generator is one thread polling all the blocking DEALER sockets: each client
still builds, sends, receives, parses and decodes every request and reply, but without
an asyncio Task and Future per request. It shares the machine's two cores with the
worker, so its own cost per request is part of what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import zmq
from _harness import EXAMPLE_CONFIG, percentiles_ms, write_result

from loadmaster.common.framing import receive_frames
from loadmaster.common.ports import free_port
from loadmaster.common.tensors import decode_tensors, encode_tensors
from loadmaster.v1 import model_pool_pb2

_REPLY_TIMEOUT_MS = 10_000
_LEAN_START_TIMEOUT_S = 60.0
_SNDMORE = int(zmq.SNDMORE)  # a plain int: pyzmq's flag enums cost microseconds per send


# The lean reference: one thread, one ROUTER, the same codec and artifact as the worker,
# batches formed the same way (up to `size` requests, waiting at most `delay_ms` after the
# first), the forward run inline. No event loop, no engine thread, no slots, no metrics: what
# the socket, the codec and the model cost on their own, to set the worker's gains against.
_LEAN_WORKER = r"""
import sys, time
import numpy as np, torch, zmq
from loadmaster.common.tensors import decode_tensors, encode_tensors
from loadmaster.v1 import model_pool_pb2 as pb

endpoint, artifact, input_name, output_name = sys.argv[1:5]
size, delay_s = int(sys.argv[5]), float(sys.argv[6]) / 1000
torch.set_num_threads(1)
model = torch.jit.load(artifact, map_location="cpu").eval()
socket = zmq.Context().socket(zmq.ROUTER)
socket.bind(endpoint)
more = int(zmq.SNDMORE)

def run(batch):
    stacked = np.concatenate([rows for _, _, rows in batch])
    with torch.inference_mode():
        outputs = model(torch.from_numpy(stacked)).numpy()
    start = 0
    for identity, request, rows in batch:
        descriptors, payload = encode_tensors({output_name: outputs[start : start + len(rows)]})
        start += len(rows)
        reply = pb.InferResponse(request_id=request.request_id, model_id=request.model_id,
                              outputs=descriptors, batch_size=len(batch))
        socket.send(identity, more); socket.send(b"", more)
        socket.send(reply.SerializeToString(), more); socket.send(payload)

print("ready", flush=True)
pending, due = [], None
while True:
    wait_ms = 1000 if due is None else max(0.0, (due - time.perf_counter()) * 1000)
    if socket.poll(wait_ms):
        while len(pending) < size:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            request = pb.InferRequest.FromString(frames[2].buffer)
            rows = np.array(decode_tensors(request.inputs, frames[3].buffer)[input_name])
            pending.append((frames[0].bytes, request, rows))
            due = due or time.perf_counter() + delay_s
    if pending and (len(pending) >= size or time.perf_counter() >= due):
        run(pending)
        pending, due = [], None
"""


@dataclass
class _Client:
    """One closed-loop client: a DEALER and the request it sends again and again.

    The request message is built once; each send only sets its new request id and
    serializes it (what changes between a client's requests), so the load generator's
    own CPU per request, which shares the machine with the worker, stays small."""

    socket: zmq.Socket[bytes]
    request: model_pool_pb2.InferRequest
    payload: bytes
    ids: itertools.count[int] = field(default_factory=itertools.count)
    sent_at: float = 0.0

    def send(self) -> None:
        self.request.request_id = str(next(self.ids))
        self.sent_at = time.perf_counter()
        # Frame by frame with int flags: half what send_multipart costs per message.
        self.socket.send(b"", _SNDMORE)
        self.socket.send(self.request.SerializeToString(), _SNDMORE)
        self.socket.send(self.payload)

    def receive(self) -> int:
        """The reply to the request in flight (checked and decoded); returns its batch size."""
        frames = receive_frames(self.socket)  # the poller saw it waiting
        reply = model_pool_pb2.InferResponse.FromString(frames[1].buffer)
        if reply.error_code:
            raise RuntimeError(f"{reply.error_code}: {reply.error_message}")
        outputs = decode_tensors(reply.outputs, frames[2].buffer)
        assert outputs["action"].shape == (1, 8)
        return reply.batch_size


def _closed_loop(
    clients: list[_Client], seconds: float, *, latencies: list[float], batches: list[int]
) -> None:
    """Every client keeps one request in flight until `seconds` pass; each reply adds its
    latency and batch size."""
    poller = zmq.Poller()
    for client in clients:
        poller.register(client.socket, zmq.POLLIN)
        client.send()
    by_socket = {client.socket: client for client in clients}
    until = time.perf_counter() + seconds
    outstanding = len(clients)
    while outstanding:
        ready = poller.poll(_REPLY_TIMEOUT_MS)
        if not ready:
            raise TimeoutError(f"no reply within {_REPLY_TIMEOUT_MS} ms")
        for sock, _ in ready:
            client = by_socket[sock]
            batches.append(client.receive())
            now = time.perf_counter()
            latencies.append(now - client.sent_at)
            if now < until:
                client.send()
            else:
                outstanding -= 1


@dataclass
class _Tally:
    """What one mode measured over its windows."""

    latencies: list[float] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def result(self) -> dict[str, Any]:
        return {
            "requests": len(self.latencies),
            "seconds": round(self.seconds, 3),
            "throughput_rps": round(len(self.latencies) / self.seconds, 1),
            "mean_batch_size": round(float(np.mean(self.batches)), 2),
            "latency": percentiles_ms(self.latencies),
        }


@dataclass
class _Mode:
    """One suite under load: its clients, its worker process and what they measured so far."""

    clients: list[_Client]
    worker: psutil.Process
    tally: _Tally = field(default_factory=_Tally)
    worker_cpu_s: float = 0.0
    client_cpu_s: float = 0.0  # this process (the load generator and its ZMQ I/O thread)

    def window(self, seconds: float) -> None:
        cpu_before = sum(self.worker.cpu_times()[:2])
        client_before = time.process_time()
        started = time.perf_counter()
        _closed_loop(self.clients, seconds, latencies=self.tally.latencies, batches=self.tally.batches)
        self.tally.seconds += time.perf_counter() - started
        self.worker_cpu_s += sum(self.worker.cpu_times()[:2]) - cpu_before
        self.client_cpu_s += time.process_time() - client_before

    def result(self) -> dict[str, Any]:
        count = len(self.tally.latencies)
        return {
            **self.tally.result(),
            "worker_cpu_us_per_request": round(self.worker_cpu_s / count * 1e6, 1),
            "load_generator_cpu_us_per_request": round(self.client_cpu_s / count * 1e6, 1),
        }


@contextlib.contextmanager
def _worker_suite(
    model: str, max_batch_size: int, *, threads: int, delay_ms: float
) -> Iterator[tuple[str, psutil.Process]]:
    """A running suite with `model` READY at `max_batch_size`: (data endpoint, worker process)."""
    from loadmaster.cli.launcher import Suite, free_port_overrides

    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = [model]
    overrides["model_pool"]["inference_threads"] = threads
    known = {"max_batch_size": max_batch_size, "max_inflight": 8, "max_queue_delay_ms": delay_ms}
    overrides["models"] = {"known": {model: known}}
    with tempfile.TemporaryDirectory(prefix="loadmaster-bench-") as logs:
        suite = Suite(EXAMPLE_CONFIG, overrides=overrides, log_dir=Path(logs))
        suite.start(timeout_s=120)
        try:
            suite.wait_for_models([model], timeout_s=120)
            worker = suite.service("model-pool")
            assert worker is not None
            yield suite.settings.model_pool.data_bind, psutil.Process(worker.process.pid)
        finally:
            suite.stop()


def _lean_signature(model: str) -> tuple[str, str, str] | None:
    """(artifact, input, output) when `model` is a TorchScript model with one input and one
    output, which the lean reference can serve; otherwise None."""
    from loadmaster.common.config import load_settings
    from loadmaster.model_pool.repository import ModelRepository

    spec = ModelRepository(load_settings(EXAMPLE_CONFIG).repository_path).spec(model)
    config = spec.config
    if spec.backend != "torch" or len(config.inputs) != 1 or len(config.outputs) != 1:
        return None
    artifact = spec.path(config.artifact)
    if artifact.suffix != ".pt":
        return None
    return str(artifact), config.inputs[0].name, config.outputs[0].name


@contextlib.contextmanager
def _lean_worker(
    signature: tuple[str, str, str], max_batch_size: int, *, delay_ms: float
) -> Iterator[tuple[str, psutil.Process]]:
    """The lean reference worker (`_LEAN_WORKER`) in its own process: (endpoint, process)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    command = [sys.executable, "-c", _LEAN_WORKER, endpoint, *signature, str(max_batch_size), str(delay_ms)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert process.stdout is not None
        started, _, _ = select.select([process.stdout], [], [], _LEAN_START_TIMEOUT_S)
        if not started or process.stdout.readline().strip() != "ready":  # EOF when it failed
            try:
                code: int | None = process.wait(5)  # it closed its stdout: it is on its way out
            except subprocess.TimeoutExpired:
                code = None
            raise RuntimeError(
                f"the lean reference worker was not ready within {_LEAN_START_TIMEOUT_S:.0f} s"
                if code is None
                else f"the lean reference worker exited with code {code} (its error is above)"
            )
        yield endpoint, psutil.Process(process.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(10)


def _measure(
    context: zmq.Context[zmq.Socket[bytes]],
    targets: dict[str, tuple[str, psutil.Process]],
    *,
    model: str,
    clients: int,
    seconds: float,
    windows: int,
) -> dict[str, dict[str, Any]]:
    """Alternate `windows` closed-loop windows per target, `seconds` in total per target."""
    rng = np.random.default_rng(0)
    states = [rng.standard_normal((1, 32)).astype(np.float32) for _ in range(clients)]
    modes: dict[str, _Mode] = {}
    for label, (endpoint, worker) in targets.items():
        loop = []
        for state in states:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            descriptors, payload = encode_tensors({"state": state})
            request = model_pool_pb2.InferRequest(model_id=model, inputs=descriptors)
            loop.append(_Client(sock, request, bytes(payload)))
        _closed_loop(loop, 1.0, latencies=[], batches=[])  # warm-up: one second, not measured
        modes[label] = _Mode(loop, worker)
    for _ in range(windows):
        for mode in modes.values():
            mode.window(seconds / windows)
    return {label: mode.result() for label, mode in modes.items()}


async def _pool_core(
    model: str, *, max_batch_size: int, delay_ms: float, clients: int, seconds: float, windows: int
) -> dict[str, dict[str, Any]]:
    """The same closed loops straight into `ModelPool.infer` (batcher + engine threads, no
    sockets), an unbatched and a batched pool in this process, in alternating windows."""
    from loadmaster.common.config import ModelSettings, load_settings
    from loadmaster.model_pool.leases import Lease
    from loadmaster.model_pool.pool import ModelPool
    from loadmaster.model_pool.repository import ModelRepository

    class _NoBroker:  # leases are off the request path; this measures the request path only
        async def acquire(self, **request: Any) -> Lease:
            return Lease("bench", 1, {0: int(request["mb"])}, sent_monotonic=time.monotonic())

        async def renew(self, lease: Lease, **_: Any) -> Lease:
            return replace(lease, sent_monotonic=time.monotonic())

        async def release(self, lease: Lease) -> None:
            pass

        async def close(self) -> None:
            pass

    settings = load_settings(EXAMPLE_CONFIG)

    async def loaded(size: int, delay: float) -> ModelPool:
        known = {**settings.models.known, model: ModelSettings(max_batch_size=size, max_queue_delay_ms=delay)}
        pool = ModelPool(
            ModelRepository(settings.repository_path),
            models=settings.models.model_copy(update={"known": known}),
            lease_client=_NoBroker(),
            threads=1,
        )
        await pool.load(model)
        return pool

    pools = {"unbatched": await loaded(1, 0.0), "batched": await loaded(max_batch_size, delay_ms)}
    state = {"state": np.zeros((1, 32), dtype=np.float32)}
    tallies = {label: _Tally() for label in pools}

    async def client(pool: ModelPool, until: float, tally: _Tally) -> None:
        while time.perf_counter() < until:
            started = time.perf_counter()
            result = await pool.infer(model, state)
            tally.latencies.append(time.perf_counter() - started)
            tally.batches.append(result.batch_size)

    async def window(label: str, seconds: float, tally: _Tally) -> None:
        started = time.perf_counter()
        await asyncio.gather(*(client(pools[label], started + seconds, tally) for _ in range(clients)))
        tally.seconds += time.perf_counter() - started

    for label in pools:
        await window(label, 1.0, _Tally())  # warm-up
    for _ in range(windows):
        for label, tally in tallies.items():
            await window(label, seconds / windows, tally)
    for pool in pools.values():
        await pool.close()
    return {label: tally.result() for label, tally in tallies.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--model", default="policy")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-queue-delay-ms", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1, help="model_pool.inference_threads")
    parser.add_argument("--windows", type=int, default=5, help="alternating windows per mode")
    args = parser.parse_args()
    print(
        f"unbatched (max_batch_size 1) vs batched (max_batch_size {args.max_batch_size}): "
        f"{args.clients} clients each, {args.windows} alternating windows, {args.seconds:.0f}s per mode …",
        flush=True,
    )
    threads, delay = args.threads, args.max_queue_delay_ms
    signature = _lean_signature(args.model)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with contextlib.ExitStack() as stack:
            targets = {
                "unbatched": stack.enter_context(_worker_suite(args.model, 1, threads=threads, delay_ms=0.0)),
                "batched": stack.enter_context(
                    _worker_suite(args.model, args.max_batch_size, threads=threads, delay_ms=delay)
                ),
            }
            if signature is not None:
                targets["lean unbatched"] = stack.enter_context(_lean_worker(signature, 1, delay_ms=0.0))
                targets["lean batched"] = stack.enter_context(
                    _lean_worker(signature, args.max_batch_size, delay_ms=delay)
                )
            measured = _measure(
                context,
                targets,
                model=args.model,
                clients=args.clients,
                seconds=args.seconds,
                windows=args.windows,
            )
    finally:
        context.destroy(linger=0)
    results = {label: measured[label] for label in ("unbatched", "batched")}
    lean = {label.removeprefix("lean "): r for label, r in measured.items() if label.startswith("lean ")}
    for label, r in measured.items():
        print(
            f"  {label}: {r['throughput_rps']:.0f} req/s, mean batch {r['mean_batch_size']}, "
            f"p50 {r['latency']['p50_ms']} ms, p99 {r['latency']['p99_ms']} ms, "
            f"worker CPU {r['worker_cpu_us_per_request']:.0f} us/request, "
            f"load generator CPU {r['load_generator_cpu_us_per_request']:.0f} us/request",
            flush=True,
        )
    gain = results["batched"]["throughput_rps"] / results["unbatched"]["throughput_rps"]
    print(f"batching gain through the data port: {gain:.2f}x (target >= 3x)")
    lean_gain = lean["batched"]["throughput_rps"] / lean["unbatched"]["throughput_rps"] if lean else None
    lean_share = results["batched"]["throughput_rps"] / lean["batched"]["throughput_rps"] if lean else None
    if lean_gain is not None and lean_share is not None:
        print(f"batching gain of the lean reference (one thread, no hand-offs): {lean_gain:.2f}x")
        print(f"batched through the data port / lean reference batched: {lean_share:.2f} (target >= 0.9)")
    else:
        print(f"no lean reference: {args.model} is not a TorchScript model with one input and one output")
    core = asyncio.run(
        _pool_core(
            args.model,
            max_batch_size=args.max_batch_size,
            delay_ms=args.max_queue_delay_ms,
            clients=args.clients,
            seconds=args.seconds,
            windows=args.windows,
        )
    )
    for label, r in core.items():
        print(f"  pool core {label}: {r['throughput_rps']:.0f} req/s, mean batch {r['mean_batch_size']}")
    core_gain = core["batched"]["throughput_rps"] / core["unbatched"]["throughput_rps"]
    print(f"batching gain in the pool core (no sockets): {core_gain:.2f}x")
    path = write_result(
        "model_pool_batching",
        {
            "model": args.model,
            "clients": args.clients,
            "path": f"{args.clients} DEALER clients (one polling thread) -> worker ZMQ data port "
            f"(real suite, real broker; {args.windows} alternating windows per mode)",
            "results": results,
            "gain": round(gain, 2),
            "pool_core": core,
            "pool_core_gain": round(core_gain, 2),
            "lean_reference": lean,
            "lean_reference_gain": round(lean_gain, 2) if lean_gain is not None else None,
            "batched_share_of_lean": round(lean_share, 2) if lean_share is not None else None,
            "load_average_1m": round(os.getloadavg()[0], 2),
            "target_gain": 3.0,
            "targets": [
                {
                    "name": f"batched / unbatched throughput, {args.model}, {args.clients} clients, data port",
                    "measured": round(gain, 2),
                    "target": 3.0,
                    "unit": "x",
                    "met": gain >= 3.0,
                },
                *(
                    [
                        {
                            "name": f"batched through the data port / lean reference batched, {args.model}",
                            "measured": round(lean_share, 2),
                            "target": 0.9,
                            "unit": "ratio",
                            "met": lean_share >= 0.9,
                        }
                    ]
                    if lean_share is not None
                    else []
                ),
            ],
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
