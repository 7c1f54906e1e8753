"""Expiry precision of the gateway's local queue: how late is the `expired` reply after the deadline?

The local-queue counterpart of `scheduler_expiry.py` (which measures the scheduler's central
queue with fake streams). Here the whole suite runs (real processes on free 127.0.0.1 ports) and
model `sleep` is configured so that its requests wait in the gateway, not at the scheduler
(docs/data-path.md): one slot (`max_inflight: 1`), the scheduler lends the gateway its whole share
(one dispatch credit, with a `LocalQueue` spec), and no call is staged behind the running one
(`lookahead: 0`), so every waiting call waits in the local queue.

- A busy client (priority 0) keeps the one slot taken: `ms=[BUSY_MS]` requests, two outstanding,
  so one always waits in the local queue ahead of everything else when the running one ends.
- `--clients` timed client processes (stock Inferential `Connection`s, priority 2) send, open loop
  at `--rate` requests/s in total, `--requests` observations of `sleep` with metadata
  `timeout_ms` drawn uniformly from 20..200 ms. Every one must come back `expired`; lateness =
  reply received - (send time + timeout_ms), both on the client's clock (so both edge hops are in).
  Replies are in order per (connection, model), so each timed client spreads its requests over a
  pool of connections and sends on one only when the new deadline is no earlier than that
  connection's last one (`pick_connection`): a reply is never held behind an earlier request
  with a later deadline, and the figure is the queue's timer, not the reply order.
- The gateway's `/healthz` (`shares.sleep.credits` / `waiting`) is polled through the run: the
  run fails unless the gateway held the share in every sample and requests waited there, so the
  bench cannot silently measure the central path instead.

Targets: p99 lateness <= 10 ms (issue 20: "expiry on time"); every timed reply `expired`.

    .venv/bin/python bench/local_expiry.py [--requests 4000] [--rate 300] [--clients 2]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import random
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import print_targets, running_suite_handle, write_result

MODEL = "sleep"
TARGET_P99_MS = 10.0
MIN_TIMEOUT_MS = 20.0
MAX_TIMEOUT_MS = 200.0
BUSY_MS = 2000.0
BUSY_OUTSTANDING = 2
CONNECTIONS = 24  # per timed client process: 16 carry 333 requests/s of 20..200 ms timeouts (unit test)
POLL_S = 0.05  # /healthz
DRAIN_S = 5.0  # after the last send, how long replies may take before they count as missing
MAX_SEND_S = 60.0
STALL_S = 0.005  # a timed client that sends this late after its schedule was not running


def pick_connection(last_deadlines: Sequence[float], deadline: float) -> int | None:
    """The connection a request with `deadline` goes on: one whose last request's deadline is no
    later (its reply then never waits behind an earlier request with a later deadline), the
    latest such one (best fit: connections with early deadlines stay free for short timeouts);
    None when every connection's last deadline is later."""
    best: int | None = None
    for index, last in enumerate(last_deadlines):
        if last <= deadline and (best is None or last > last_deadlines[best]):
            best = index
    return best


_WAITED = re.compile(r"expired after waiting (\d+(?:\.\d+)?) ms")


def gateway_waited_ms(message: str) -> float | None:
    """The wait the gateway states in its `expired` message ("expired after waiting 39 ms for
    model 'sleep'", whole ms), or None when the message says none."""
    match = _WAITED.search(message)
    return float(match.group(1)) if match else None


def late_bunches(times_s: Sequence[float], gap_s: float = 0.05) -> list[tuple[float, int]]:
    """Sorted event times grouped where less than `gap_s` apart: (first time, count) per group."""
    bunches: list[tuple[float, int]] = []
    previous: float | None = None
    for at in times_s:
        if previous is not None and at - previous < gap_s:
            first, count = bunches[-1]
            bunches[-1] = (first, count + 1)
        else:
            bunches.append((at, 1))
        previous = at
    return bunches


def lateness_summary(lateness_s: Sequence[float]) -> dict[str, float | int | None]:
    """Count, p50/p99/max and min (negative: answered before its deadline) in ms."""
    if not lateness_s:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None, "min_ms": None}
    values = np.asarray(lateness_s, dtype=float) * 1000.0
    return {
        "count": int(values.size),
        "p50_ms": round(float(np.percentile(values, 50)), 3),
        "p99_ms": round(float(np.percentile(values, 99)), 3),
        "max_ms": round(float(values.max()), 3),
        "min_ms": round(float(values.min()), 3),
    }


# -- client processes ------------------------------------------------------------------------


def _wait_until_wall(at: float) -> None:
    while (left := at - time.time()) > 0.002:
        time.sleep(left - 0.002)
    while time.time() < at:
        pass


def busy_client(edge: str, busy_ms: float, ready: Any, stop: Any, out: Any) -> None:
    """Keep the model's one slot taken: BUSY_OUTSTANDING long requests in flight until `stop`."""
    from inferential import Connection

    conn = Connection(server=edge, client_id="local-expiry-busy")
    model = conn.model(MODEL, priority=0)
    ms = np.array([busy_ms], dtype=np.float32)
    codes: dict[str, int] = {}
    outstanding = 0
    for _ in range(BUSY_OUTSTANDING):
        model.observe(ms=ms, priority=0)
        outstanding += 1
    ready.put("busy")
    hard_end = time.monotonic() + MAX_SEND_S + 3 * busy_ms / 1000.0 + 30.0
    while outstanding and time.monotonic() < hard_end:
        result = model.get_result(timeout_ms=100)
        if result is None:
            continue
        outstanding -= 1
        code = str(result.get("error_code", "ok"))
        codes[code] = codes.get(code, 0) + 1
        if not stop.is_set():
            model.observe(ms=ms, priority=0)
            outstanding += 1
    conn.close()
    out.put(("busy", {"codes": codes, "unanswered": outstanding}))


def timed_client(
    edge: str,
    index: int,
    timeouts_ms: list[float],
    rate_hz: float,
    phase_s: float,
    connections: int,
    ready: Any,
    go: Any,
    start: Any,
    out: Any,
) -> None:
    """Send `timeouts_ms` (one observation each) open loop at `rate_hz`; report every reply."""
    import zmq
    from inferential import Connection

    conns = [Connection(server=edge, client_id=f"local-expiry-{index}-{k}") for k in range(connections)]
    models = [conn.model(MODEL, priority=2) for conn in conns]
    poller = zmq.Poller()
    by_socket: dict[Any, int] = {}
    for k, conn in enumerate(conns):
        socket = conn._socket  # the stock client's DEALER: one poll over every connection
        poller.register(socket, zmq.POLLIN)
        by_socket[socket] = k
    ms = np.array([0.0], dtype=np.float32)  # if one ever ran, it would answer at once, `ok`
    outstanding: list[deque[tuple[float, float]]] = [deque() for _ in conns]  # (deadline, timeout)
    last_deadline = [-np.inf] * connections
    # (timeout_ms, lateness_s, code, message, deadline_s after the clients' common start)
    samples: list[tuple[float, float, str, str, float]] = []
    skipped = 0
    stalls: list[tuple[float, float]] = []  # (at_s, ms): sends this late, the client itself stalled
    ready.put(index)
    if not go.wait(60):
        return
    _wait_until_wall(start.value + phase_s)
    period = 1.0 / rate_hz
    t0 = time.monotonic()
    next_send = t0
    sent = 0
    in_flight = 0
    hard_end = t0 + len(timeouts_ms) * period + MAX_TIMEOUT_MS / 1000.0 + DRAIN_S
    while True:
        now = time.monotonic()
        if sent < len(timeouts_ms) and now >= next_send:
            if now - next_send > STALL_S:
                stalls.append((round(next_send - t0 + phase_s, 3), round((now - next_send) * 1000.0, 1)))
            timeout_ms = timeouts_ms[sent]
            chosen = pick_connection(last_deadline, now + timeout_ms / 1000.0)
            if chosen is None:
                skipped += 1
            else:
                sent_at = time.monotonic()
                models[chosen].observe(ms=ms, priority=2, timeout_ms=f"{timeout_ms:.3f}")
                deadline = sent_at + timeout_ms / 1000.0
                outstanding[chosen].append((deadline, timeout_ms))
                last_deadline[chosen] = deadline
                in_flight += 1
            sent += 1
            next_send += period
            continue
        if (sent >= len(timeouts_ms) and not in_flight) or now >= hard_end:
            break
        until = next_send if sent < len(timeouts_ms) else hard_end
        events = poller.poll(max(0, math.ceil((until - now) * 1000.0)))
        replied_at = time.monotonic()
        for socket, _ in events:
            k = by_socket[socket]
            while (result := models[k].get_result(timeout_ms=0)) is not None:
                deadline, timeout_ms = outstanding[k].popleft()
                in_flight -= 1
                code = str(result.get("error_code", "ok"))
                message = str(result.get("error", ""))
                samples.append((timeout_ms, replied_at - deadline, code, message, deadline - t0 + phase_s))
    for conn in conns:
        conn.close()
    out.put((index, {"samples": samples, "skipped": skipped, "unanswered": in_flight, "stalls": stalls}))


# -- the gateway's view ----------------------------------------------------------------------


class ShareWatch:
    """Polls the gateway's /healthz in a thread: the `sleep` share and local queue over time."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._http = httpx.Client()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="share-watch", daemon=True)
        self.samples: list[tuple[int, int]] = []  # (credits, waiting)
        self.errors = 0

    def read(self) -> tuple[int, int]:
        share = self._http.get(self._url, timeout=2.0).json().get("shares", {}).get(MODEL, {})
        return int(share.get("credits", 0)), int(share.get("waiting", 0))

    def wait_for(self, predicate: Any, timeout_s: float) -> tuple[int, int] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen = self.read()
            if predicate(*seen):
                return seen
            time.sleep(POLL_S)
        return None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._http.close()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.samples.append(self.read())
            except httpx.HTTPError:
                self.errors += 1


# -- the run ---------------------------------------------------------------------------------


def run(suite: Any, args: argparse.Namespace, slots: int) -> dict[str, Any]:
    from inferential import Connection

    gw = suite.settings.gateway
    edge = gw.edge.bind
    watch = ShareWatch(f"http://{gw.http_host}:{gw.http_port}/healthz")
    # A first call makes this gateway the model's user: the scheduler lends it the whole share.
    warm = Connection(server=edge, client_id="local-expiry-warm")
    warm.model(MODEL).observe(ms=np.array([0.0], dtype=np.float32))
    first = warm.model(MODEL).get_result(timeout_ms=10_000)
    warm.close()
    if first is None or "error" in first:
        raise SystemExit(f"FAIL: the warm-up call to {MODEL!r} failed: {first}")
    if watch.wait_for(lambda credits, waiting: credits == slots, 15.0) is None:
        raise SystemExit(
            f"FAIL: the gateway never held {MODEL!r}'s whole share ({slots} credits): its requests "
            "would queue at the scheduler, not in the gateway; this bench measures the local queue only"
        )
    ctx = mp.get_context("spawn")
    out, ready, go, stop, start = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
    busy = ctx.Process(target=busy_client, args=(edge, args.busy_ms, ready, stop, out))
    busy.start()
    procs = [busy]
    try:
        ready.get(timeout=60)
        if watch.wait_for(lambda credits, waiting: credits == slots and waiting >= 1, 15.0) is None:
            raise SystemExit(
                f"FAIL: the busy client's second request did not wait in the gateway's local queue "
                f"(shares.{MODEL}.waiting stayed 0): the bench would not measure the local queue"
            )
        rng = random.Random(args.seed)
        timeouts = [rng.uniform(MIN_TIMEOUT_MS, MAX_TIMEOUT_MS) for _ in range(args.requests)]
        per_client_rate = args.rate / args.clients
        for i in range(args.clients):
            procs.append(
                ctx.Process(
                    target=timed_client,
                    args=(
                        edge,
                        i,
                        timeouts[i :: args.clients],
                        per_client_rate,
                        i / args.rate,  # the clients' sends interleave
                        args.connections,
                        ready,
                        go,
                        start,
                        out,
                    ),
                )
            )
            procs[-1].start()
        for _ in range(args.clients):
            ready.get(timeout=60)
        watch.start()
        gateway = psutil.Process(suite.service("gateway").process.pid)
        cpu_before, wall_before, load_before = sum(gateway.cpu_times()[:2]), time.monotonic(), os.getloadavg()
        psutil.cpu_times_percent()  # starts the machine-wide window read below
        start.value = time.time() + 0.3
        go.set()
        reports: dict[Any, dict[str, Any]] = {}
        send_s = args.requests / args.rate
        for _ in range(args.clients):
            index, report = out.get(timeout=send_s + MAX_TIMEOUT_MS / 1000.0 + DRAIN_S + 60)
            reports[index] = report
        watch.stop()
        cpu_s, wall_s = sum(gateway.cpu_times()[:2]) - cpu_before, time.monotonic() - wall_before
        load_after = os.getloadavg()
        machine = psutil.cpu_times_percent()
        stop.set()
        name, busy_report = out.get(timeout=3 * args.busy_ms / 1000.0 + 30)
        reports[name] = busy_report
    finally:
        stop.set()
        for process in procs:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)
    samples = [s for i in range(args.clients) for s in reports[i]["samples"]]
    codes: dict[str, int] = {}
    for _, _, code, *_ in samples:
        codes[code] = codes.get(code, 0) + 1
    expired = [lateness for _, lateness, code, *_ in samples if code == "expired"]
    messages = [message for _, _, code, message, _ in samples if code == "expired"][:1]
    # The gateway's own part: the wait its message states (whole ms) minus the timeout, so
    # within +-0.5 ms the time its timer fired after the deadline it computed on arrival.
    gateway_late = [
        (waited - timeout) / 1000.0
        for timeout, _, code, message, _ in samples
        if code == "expired" and (waited := gateway_waited_ms(message)) is not None
    ]
    unanswered = sum(reports[i]["unanswered"] for i in range(args.clients))
    skipped = sum(reports[i]["skipped"] for i in range(args.clients))
    credits_seen = [credits for credits, _ in watch.samples]
    waiting_seen = [waiting for _, waiting in watch.samples]
    # Each reply later than the target: when (s after the start), how late in all and by the
    # gateway's own account; late replies bunched in time point at a stalled process.
    late = [
        {
            "at_s": round(at, 3),
            "timeout_ms": round(timeout, 1),
            "late_ms": round(lateness * 1000.0, 2),
            "gateway_late_ms": None
            if (waited := gateway_waited_ms(message)) is None
            else round(waited - timeout, 1),
        }
        for timeout, lateness, code, message, at in sorted(samples, key=lambda s: s[4])
        if code == "expired" and lateness * 1000.0 > TARGET_P99_MS
    ]
    buckets = {}
    for low in range(int(MIN_TIMEOUT_MS), int(MAX_TIMEOUT_MS), 60):
        high = low + 60
        buckets[f"{low}-{high}ms"] = lateness_summary(
            [lat for t, lat, code, *_ in samples if code == "expired" and low <= t < high]
        )
    return {
        "samples": samples,
        "lateness": lateness_summary(expired),
        "gateway_timer_lateness_1ms_resolution": lateness_summary(gateway_late),
        "gateway_cpu_percent_of_one_core": round(100.0 * cpu_s / wall_s, 1),
        "load_average_1min_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "machine_cpu_percent": {
            key: round(float(getattr(machine, key, 0.0)), 1) for key in ("user", "system", "idle", "steal")
        },
        "lateness_by_timeout": buckets,
        "late_replies": late,
        "client_stalls": {str(i): reports[i]["stalls"] for i in range(args.clients)},
        "replies": codes,
        "not_expired": len(samples) - len(expired) + unanswered,
        "unanswered": unanswered,
        "skipped_no_connection": skipped,
        "example_message": messages[0] if messages else None,
        "busy": reports.get("busy"),
        "share": {
            "polls": len(watch.samples),
            "poll_errors": watch.errors,
            "credits_min": min(credits_seen, default=0),
            "credits_max": max(credits_seen, default=0),
            "waiting_max": max(waiting_seen, default=0),
            "waiting_mean": round(float(np.mean(waiting_seen)), 1) if waiting_seen else 0.0,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--rate", type=float, default=300.0, help="timed requests/s, all clients together")
    parser.add_argument("--clients", type=int, default=2, help="timed client processes")
    parser.add_argument("--connections", type=int, default=CONNECTIONS, help="per timed client process")
    parser.add_argument("--busy-ms", type=float, default=BUSY_MS)
    parser.add_argument("--seed", type=int, default=20)
    args = parser.parse_args()
    if args.requests / args.rate > MAX_SEND_S:
        parser.error(f"--requests / --rate is over {MAX_SEND_S:.0f} s of sending")
    slots = 1
    overrides = {
        "models": {"known": {MODEL: {"max_inflight": slots, "lookahead": 0}}},
    }
    with running_suite_handle(preload=[MODEL], overrides=overrides) as suite:
        pid = suite.service("gateway").process.pid
        print(
            f"gateway pid {pid}; sending {args.requests} requests at {args.rate:.0f}/s from "
            f"{args.clients} clients…",
            flush=True,
        )
        result = run(suite, args, slots)
    share = result["share"]
    lateness = result["lateness"]
    if share["credits_min"] != slots or share["waiting_max"] < 2:
        print(f"FAIL: the share was not held locally through the run: {share}")
        return 1
    p99 = lateness["p99_ms"]
    targets = [
        {
            "name": "local queue: expired reply - deadline, p99",
            "measured": p99,
            "target": TARGET_P99_MS,
            "unit": "ms",
            "met": p99 is not None and p99 <= TARGET_P99_MS,
        },
        {
            "name": "local queue: timed replies not `expired` (other codes, ok, none)",
            "measured": result["not_expired"],
            "target": 0,
            "unit": "",
            "met": result["not_expired"] == 0 and result["skipped_no_connection"] == 0,
        },
    ]
    samples = result.pop("samples")
    path = write_result(
        "local_expiry",
        {
            "model": MODEL,
            "slots": slots,
            "requests": args.requests,
            "rate_rps": args.rate,
            "clients": args.clients,
            "connections_per_client": args.connections,
            "timeout_ms_range": [MIN_TIMEOUT_MS, MAX_TIMEOUT_MS],
            "busy_ms": args.busy_ms,
            **result,
            "targets": targets,
        },
    )
    print(
        f"replies: {result['replies']}; unanswered {result['unanswered']}; skipped {result['skipped_no_connection']}"
    )
    print(f"share during the run: {share}")
    print(f"lateness (ms): {lateness}")
    print(
        f"  of which the gateway's timer (its message, whole ms): {result['gateway_timer_lateness_1ms_resolution']}"
    )
    print(
        f"gateway CPU {result['gateway_cpu_percent_of_one_core']} % of one core; "
        f"load average {result['load_average_1min_before_after']}; machine CPU % {result['machine_cpu_percent']}"
    )
    for bucket, summary in result["lateness_by_timeout"].items():
        print(f"  timeout {bucket}: {summary}")
    late = result["late_replies"]
    if late:
        bunches = late_bunches([r["at_s"] for r in late])
        print(
            f"{len(late)} replies over {TARGET_P99_MS:.0f} ms late, in {len(bunches)} bunches (start s, count):"
        )
        print(f"  {bunches[:12]}")
        gateway_part = [r["gateway_late_ms"] for r in late if r["gateway_late_ms"] is not None]
        print(
            f"  gateway's own part of those: median {np.median(gateway_part) if gateway_part else None} ms, "
            f"over {TARGET_P99_MS:.0f} ms in {sum(1 for g in gateway_part if g > TARGET_P99_MS)}"
        )
    stalls = sorted(stall for per in result["client_stalls"].values() for stall in per)
    print(
        f"timed clients sent over {STALL_S * 1000:.0f} ms behind schedule {len(stalls)} times "
        f"(at s, ms): {stalls[:12]}"
    )
    print(f"sample message: {result['example_message']!r}; {len(samples)} replies")
    print_targets(targets, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
