"""Dynamic batching gain: `policy` with N concurrent clients, batched vs unbatched.

    .venv/bin/python bench/model_pool_batching.py [--clients 8] [--seconds 5] [--model policy]

Starts the real suite twice on free ports (`loadmaster.cli.launcher.Suite`, the
example config, only the model preloaded): once with `max_batch_size` 1 (no
batching) and once with the model's batching config (`max_batch_size` 8). Each run
drives the worker's real ZMQ data port with N DEALER clients, each sending its next
request as soon as the previous reply arrives (closed loop), for a fixed time.
Prints requests/s, latency percentiles and the mean batch size the worker reported,
then the same closed loop straight into `ModelPool.infer` in this process (the pool
core: batcher + engine threads, no sockets), and writes
bench/results/model_pool_batching.json (with the machine's load average: other work
on a 2-core machine moves these numbers a lot). Target: batched >= 3x unbatched.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.asyncio
from _harness import EXAMPLE_CONFIG, percentiles_ms, write_result

from loadmaster.common.tensors import decode_tensors, encode_tensors
from loadmaster.v1 import model_pool_pb2


async def _client(
    context: zmq.asyncio.Context,
    endpoint: str,
    model: str,
    state: np.ndarray,
    *,
    until: float,
    latencies: list[float],
    batches: list[int],
) -> int:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    descriptors, payload = encode_tensors({"state": state})
    ids = itertools.count()
    done = 0
    try:
        while time.perf_counter() < until:
            request = model_pool_pb2.InferRequest(
                request_id=str(next(ids)), model_id=model, inputs=descriptors
            )
            started = time.perf_counter()
            await sock.send_multipart([b"", request.SerializeToString(), bytes(payload)])
            frames = await asyncio.wait_for(sock.recv_multipart(), 10.0)
            latencies.append(time.perf_counter() - started)
            reply = model_pool_pb2.InferReply.FromString(frames[1])
            if reply.error_code:
                raise RuntimeError(f"{reply.error_code}: {reply.error_message}")
            outputs = decode_tensors(reply.outputs, frames[2])
            assert outputs["action"].shape == (1, 8)
            batches.append(reply.batch_size)
            done += 1
    finally:
        sock.close()
    return done


async def _drive(endpoint: str, model: str, clients: int, seconds: float) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    states = [rng.standard_normal((1, 32)).astype(np.float32) for _ in range(clients)]
    context = zmq.asyncio.Context()
    try:
        return await _measure(context, endpoint, model, states, seconds)
    finally:
        context.term()


async def _measure(
    context: zmq.asyncio.Context, endpoint: str, model: str, states: list[np.ndarray], seconds: float
) -> dict[str, Any]:
    warm_until = time.perf_counter() + 1.0  # warm-up: one second, not measured
    await asyncio.gather(
        *(_client(context, endpoint, model, s, until=warm_until, latencies=[], batches=[]) for s in states)
    )
    latencies: list[float] = []
    batches: list[int] = []
    started = time.perf_counter()
    counts = await asyncio.gather(
        *(
            _client(
                context, endpoint, model, s, until=started + seconds, latencies=latencies, batches=batches
            )
            for s in states
        )
    )
    elapsed = time.perf_counter() - started
    return {
        "requests": sum(counts),
        "seconds": round(elapsed, 3),
        "throughput_rps": round(sum(counts) / elapsed, 1),
        "mean_batch_size": round(float(np.mean(batches)), 2),
        "latency": percentiles_ms(latencies),
    }


def _run(
    model: str, max_batch_size: int, clients: int, seconds: float, threads: int, delay_ms: float
) -> dict[str, Any]:
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
            endpoint = suite.settings.model_pool.data_bind
            return asyncio.run(_drive(endpoint, model, clients, seconds))
        finally:
            suite.stop()


async def _pool_core(
    model: str, max_batch_size: int, clients: int, seconds: float, delay_ms: float
) -> dict[str, Any]:
    """The same closed loop straight into `ModelPool.infer` (batcher + engine threads, no sockets)."""
    from loadmaster.common.config import ModelSettings, load_settings
    from loadmaster.model_pool.leases import Lease
    from loadmaster.model_pool.pool import ModelPool
    from loadmaster.model_pool.repository import ModelRepository

    class _NoBroker:  # leases are off the request path; this measures the request path only
        async def acquire(self, **request: Any) -> Lease:
            return Lease("bench", 1, {0: int(request["mb"])})

        async def renew(self, lease: Lease, **_: Any) -> Lease:
            return lease

        async def release(self, lease: Lease) -> None:
            pass

        async def close(self) -> None:
            pass

    settings = load_settings(EXAMPLE_CONFIG)
    models = settings.models.model_copy(
        update={
            "known": {
                **settings.models.known,
                model: ModelSettings(max_batch_size=max_batch_size, max_queue_delay_ms=delay_ms),
            }
        }
    )
    pool = ModelPool(
        ModelRepository(settings.repository_path), models=models, lease_client=_NoBroker(), threads=1
    )
    await pool.load(model)
    state = {"state": np.zeros((1, 32), dtype=np.float32)}
    latencies: list[float] = []
    batches: list[int] = []

    async def client(until: float) -> int:
        done = 0
        while time.perf_counter() < until:
            started = time.perf_counter()
            result = await pool.infer(model, state)
            latencies.append(time.perf_counter() - started)
            batches.append(result.batch_size)
            done += 1
        return done

    await asyncio.gather(*(client(time.perf_counter() + 1.0) for _ in range(clients)))
    latencies.clear()
    batches.clear()
    started = time.perf_counter()
    counts = await asyncio.gather(*(client(started + seconds) for _ in range(clients)))
    elapsed = time.perf_counter() - started
    await pool.close()
    return {
        "requests": sum(counts),
        "throughput_rps": round(sum(counts) / elapsed, 1),
        "mean_batch_size": round(float(np.mean(batches)), 2),
        "latency": percentiles_ms(latencies),
    }


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
    args = parser.parse_args()
    results = {}
    for label, size in (("unbatched", 1), ("batched", args.max_batch_size)):
        print(f"{label}: max_batch_size={size}, {args.clients} clients, {args.seconds:.0f}s …", flush=True)
        delay = args.max_queue_delay_ms if size > 1 else 0.0
        results[label] = _run(args.model, size, args.clients, args.seconds, args.threads, delay)
        r = results[label]
        print(
            f"  {r['throughput_rps']:.0f} req/s, mean batch {r['mean_batch_size']}, "
            f"p50 {r['latency']['p50_ms']} ms, p99 {r['latency']['p99_ms']} ms",
            flush=True,
        )
    gain = results["batched"]["throughput_rps"] / results["unbatched"]["throughput_rps"]
    print(f"batching gain through the data port: {gain:.2f}x (target >= 3x)")
    core = {}
    for label, size in (("unbatched", 1), ("batched", args.max_batch_size)):
        delay = args.max_queue_delay_ms if size > 1 else 0.0
        core[label] = asyncio.run(_pool_core(args.model, size, args.clients, args.seconds, delay))
        print(
            f"  pool core {label}: {core[label]['throughput_rps']:.0f} req/s, "
            f"mean batch {core[label]['mean_batch_size']}",
            flush=True,
        )
    core_gain = core["batched"]["throughput_rps"] / core["unbatched"]["throughput_rps"]
    print(f"batching gain in the pool core (no sockets): {core_gain:.2f}x")
    path = write_result(
        "model_pool_batching",
        {
            "model": args.model,
            "clients": args.clients,
            "path": "8 DEALER clients -> worker ZMQ data port (real suite, real broker)",
            "results": results,
            "gain": round(gain, 2),
            "pool_core": core,
            "pool_core_gain": round(core_gain, 2),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "target_gain": 3.0,
            "targets": [
                {
                    "name": f"batched / unbatched throughput, {args.model}, {args.clients} clients, data port",
                    "measured": round(gain, 2),
                    "target": 3.0,
                    "unit": "x",
                    "met": gain >= 3.0,
                }
            ],
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
