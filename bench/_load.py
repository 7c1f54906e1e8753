"""Load from several client processes, each a stock Inferential client.

Closed loop (`rate_hz=None`): every client sends its next observation as soon as the
previous reply arrives — throughput. Open loop (`rate_hz`): every client sends on a fixed
cadence, like a robot's control loop — latency at a given load. Bounded by `duration_s`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

__all__ = ["LoadResult", "run_load", "start_delay_for"]


@dataclass
class LoadResult:
    requests: int = 0
    errors: int = 0
    timeouts: int = 0
    duration_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    first_latencies_s: list[float] = field(default_factory=list)  # each client's first answer
    error_codes: dict[str, int] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


def _client(
    edge: str,
    model_id: str,
    inputs: dict[str, np.ndarray],
    duration_s: float,
    rate_hz: float | None,
    start_at: float,
    queue: mp.Queue,
    warm_up_model: str | None = None,
) -> None:
    from inferential import Connection

    conn = Connection(server=edge, client_id=f"load-{uuid.uuid4().hex[:8]}")
    model = conn.model(model_id)
    latencies: list[float] = []
    errors: dict[str, int] = {}
    timeouts = 0
    if warm_up_model is not None:  # the connection's first contact, before the clock starts
        warm_up = conn.model(warm_up_model)
        warm_up.observe(**inputs)
        warm_up.get_result(timeout_ms=5000)
    while time.time() < start_at:
        time.sleep(0.001)
    begin = time.perf_counter()
    next_send = begin
    while time.perf_counter() - begin < duration_s:
        if rate_hz is not None:
            delay = next_send - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            next_send += 1.0 / rate_hz
        sent = time.perf_counter()
        model.observe(**inputs)
        result = model.get_result(timeout_ms=5000)
        if result is None:
            timeouts += 1
            continue
        if "error_code" in result:
            errors[result["error_code"]] = errors.get(result["error_code"], 0) + 1
            continue
        latencies.append(time.perf_counter() - sent)
    conn.close()
    queue.put((latencies, errors, timeouts, time.perf_counter() - begin))


def start_delay_for(clients: int, cpus: int | None = None) -> float:
    """A start delay long enough for `clients` spawned processes to import on `cpus` cores
    (~0.3 s of CPU each, with margin), never under the old fixed 1.5 s."""
    cores = max(1, cpus if cpus is not None else (os.cpu_count() or 1))
    return max(1.5, 1.0 + 0.5 * clients / cores)


def run_load(
    edge: str,
    model_id: str,
    inputs: dict[str, np.ndarray],
    *,
    clients: int,
    duration_s: float,
    rate_hz: float | None = None,
    start_delay_s: float = 1.5,
    warm_up_model: str | None = None,
) -> LoadResult:
    """`start_delay_s`: how long the clients get to start and import before they all begin
    together (each spawned process imports numpy and inferential: ~0.3 s of CPU; raise it
    for many clients on few cores, see `start_delay_for`).
    `warm_up_model`: each client first sends one call there (a model that does not exist
    answers at once) and ignores its answer, so its first timed call is not its connection's
    first contact.
    """
    context = mp.get_context("spawn")
    queue: mp.Queue = context.Queue()
    start_at = time.time() + start_delay_s  # all clients start together, after their imports
    processes = [
        context.Process(
            target=_client,
            args=(edge, model_id, inputs, duration_s, rate_hz, start_at, queue, warm_up_model),
        )
        for _ in range(clients)
    ]
    for process in processes:
        process.start()
    result = LoadResult()
    durations = []
    for _ in processes:
        latencies, errors, timeouts, elapsed = queue.get(timeout=duration_s + 60)
        result.latencies_s += latencies
        result.first_latencies_s += latencies[:1]
        result.requests += len(latencies)
        result.timeouts += timeouts
        for code, count in errors.items():
            result.error_codes[code] = result.error_codes.get(code, 0) + count
            result.errors += count
        durations.append(elapsed)
    for process in processes:
        process.join(10)
        if process.is_alive():
            process.kill()
    result.duration_s = max(durations)
    return result
