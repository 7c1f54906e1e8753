"""Where the CPU of one request goes: each suite process profiled under closed-loop load.

    python bench/profile_data_path.py                 # 8 clients, 6 s profiled, 100 Hz, GIL samples
    python bench/profile_data_path.py --clients 4 --seconds 10 --rate 200
    python bench/profile_data_path.py --all-samples   # py-spy's default: every non-idle sample
    python bench/profile_data_path.py --native        # C frames too (uvloop, grpc, zmq); pauses

Starts the suite (`_harness.running_suite_handle`, `double` preloaded, `max_inflight` 4 as in
compare_inferential) and runs `--clients` closed-loop client processes (`_load.run_load`, stock
inferential client, `double` with 7 x float32) twice:

1. unprofiled, `--seconds` long: requests/s, and the CPU seconds of every suite process
   (gateway, scheduler, model-pool, gpu-broker, metrics, redis; children included) over the
   run divided by the requests served, in µs per request;
2. the same load while `py-spy record` samples the gateway, scheduler and model-pool
   processes for `--seconds` inside the load window (raw collapsed stacks, one line per
   distinct stack with its sample count, frames aggregated per function, one root frame per
   thread).

Which samples count (the denominator of every %):
- default, `--gil`: only samples in which a thread holds the GIL, i.e. Python work and the C
  work it runs without releasing the GIL (protobuf, grpc's Cython layer, pyzmq's send). C work
  done without the GIL (libzmq's I/O thread, grpc's core threads) is not in the profile; it is
  in the CPU per request.
- `--all-samples`: py-spy's own idle filter. It counts a thread blocked inside C as active, so
  the self time of `Runner.run` (uvloop's loop in epoll), `Thread.run` (grpc's poller thread)
  and `_worker` (an executor thread in `queue.get`) is mostly waiting there.
- `--native` (implies `--blocking` and all samples): C frames as well; samples whose leaf is a
  wait (epoll, poll, futex, a lock or condition wait) are counted as waiting and left out.

Per profiled process it prints the top self frames (where the samples were taken) and top
inclusive frames (on the stack at all; start-up plumbing such as runpy, the thread bootstrap and
asyncio's runner left out) as % of samples, the share of each thread, and an estimate of the CPU
µs per request each frame stands for (its share x the process's µs per request from run 1:
approximate, the two runs differ and sampling is wall-clock).

py-spy needs ptrace (root, or kernel.yama.ptrace_scope 0). Where it cannot attach, the script
says so and still prints and writes the CPU per request per process.
Writes bench/results/profile_data_path.json, and the collapsed stacks under
bench/results/profiles/ when each is under 256 KiB (open them in https://speedscope.app or
flamegraph.pl).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _harness import RESULTS, running_suite_handle, write_result
from _load import LoadResult, run_load, start_delay_for
from idle_probe import cpu_by_name, cpu_us_per_request, process_tree

SMALL = {"x": np.arange(7, dtype=np.float32)}
PROFILED = ("gateway", "scheduler", "model-pool")
PROFILES = RESULTS / "profiles"
MAX_STACKS_BYTES = 256 * 1024
SETTLE_S = 2.0
MARGIN_S = 1.0  # load before and after the profiled window, so py-spy sees only steady state
# Frames every stack of a thread carries: left out of the inclusive ranking, where they would
# stand at ~100 % and say nothing.
PLUMBING = (
    "<frozen runpy>",
    "threading.py:",
    "asyncio/runners.py:",
    "common/service.py:",
    "/__main__.py:",
    "(__main__.py:",
)


# py-spy's `--threads` root frame, "thread (12345): MainThread" (a function named `thread`
# shows as "thread (file.py:3)", which this does not match).
_THREAD = re.compile(r"thread \((?:0x)?[0-9a-fA-F]+\)(?:: (.*))?")


# Native leaf frames that block in the kernel, and the callers whose unnamed libc leaf is a
# futex wait (a lock, the GIL, a condition), for `--native` profiles.
WAIT_CALLS = (
    "epoll_wait",
    "epoll_pwait",
    "poll (",
    "ppoll",
    "select (",
    "pselect",
    "nanosleep",
    "clock_nanosleep",
    "futex",
    "__futex",
    "pthread_cond_wait",
    "pthread_cond_timedwait",
    "sem_wait",
    "sem_timedwait",
    "sem_clockwait",
    "recv (",
    "read (",
)
WAIT_CALLERS = (
    "PyThread_acquire_lock_timed",
    "take_gil",
    "PyCOND_TIMEDWAIT",
    "_queue_SimpleQueue_get",
    "pthread_cond_",
    "sem_",
    "gpr_cv_wait",
)


@dataclass(frozen=True, slots=True)
class Profile:
    """Sample counts from py-spy's raw (collapsed) output."""

    samples: int  # counted samples (waiting ones left out)
    waiting: int  # samples left out as waiting (`drop_waiting`)
    self_counts: Counter[str]
    inclusive_counts: Counter[str]
    thread_counts: Counter[str]


def _is_waiting(frames: list[str]) -> bool:
    """A native stack blocked in the kernel: its leaf is a wait, or an unnamed libc frame right
    under a lock or condition wait."""
    leaf = frames[-1]
    if leaf.startswith(WAIT_CALLS):
        return True
    return "(libc" in leaf and any(frame.startswith(WAIT_CALLERS) for frame in frames[-4:-1])


def parse_collapsed(lines: Iterable[str], *, drop_waiting: bool = False) -> Profile:
    """Count self, inclusive and per-thread samples in collapsed stacks ("a;b;c 12" per line,
    root first). A leading "process …" and "thread (tid): name" frame (py-spy's
    `--subprocesses` and `--threads`) name the thread, by its name alone, and are not counted
    as frames; a frame that appears twice in one stack (recursion) counts once inclusively. A
    line that does not end in a count continues on the next (a command line with newlines).
    `drop_waiting` (native stacks) counts stacks blocked in a wait apart, under `waiting`."""
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    samples = waiting = 0
    pending = ""
    for raw in lines:
        line = pending + raw.rstrip("\n")
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            pending = line + "\n" if line else ""
            continue
        pending = ""
        count = int(count_text)
        frames = stack.split(";")
        thread = "all threads"
        # The thread frame ends the header (a process frame's command line may hold a ";").
        heads = [i for i, frame in enumerate(frames) if _THREAD.fullmatch(frame)]
        if heads:
            thread = _THREAD.fullmatch(frames[heads[0]]).group(1) or frames[heads[0]]  # type: ignore[union-attr]
            frames = frames[heads[0] + 1 :]
        elif frames[0].startswith("process "):
            frames = frames[1:]
        if not frames:
            continue
        if drop_waiting and _is_waiting(frames):
            waiting += count
            continue
        samples += count
        threads[thread] += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return Profile(samples, waiting, self_counts, inclusive, threads)


def top_frames(
    counts: Counter[str],
    samples: int,
    *,
    limit: int,
    us_per_request: float | None = None,
    skip: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """The `limit` largest counts as % of `samples` (and the µs per request each share of
    `us_per_request` stands for), leaving out frames that contain any of `skip`."""
    rows = []
    for frame, count in counts.most_common():
        if any(part in frame for part in skip):
            continue
        share = count / samples if samples else 0.0
        row: dict[str, Any] = {"frame": frame, "percent": round(share * 100, 1)}
        if us_per_request is not None:
            row["us_per_request"] = round(share * us_per_request, 1)
        rows.append(row)
        if len(rows) == limit:
            break
    return rows


def _py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _cpu_run(
    edge: str, pids: dict[str, int], clients: int, seconds: float
) -> tuple[LoadResult, dict[str, float]]:
    trees = {name: process_tree(pid) for name, pid in pids.items()}
    before = cpu_by_name(trees)
    load = run_load(
        edge, "double", SMALL, clients=clients, duration_s=seconds, start_delay_s=start_delay_for(clients)
    )
    return load, cpu_us_per_request(before, cpu_by_name(trees), load.requests)


def _record(
    py_spy: str, pid: int, output: Path, *, seconds: float, rate: int, gil: bool, native: bool, blocking: bool
) -> subprocess.Popen[bytes]:
    command = [py_spy, "record", "-p", str(pid), "-d", str(max(1, round(seconds))), "-r", str(rate)]
    command += ["-f", "raw", "-o", str(output), "--function", "--threads", "--subprocesses"]
    command += ["--gil"] * gil + ["--native"] * native + ["--nonblocking"] * (not blocking)
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _profiled_run(
    edge: str, targets: dict[str, int], args: argparse.Namespace, py_spy: str, workdir: Path
) -> tuple[LoadResult, dict[str, Path], dict[str, str]]:
    """The load with py-spy attached to each target for `args.seconds` inside it."""
    delay = start_delay_for(args.clients)
    box: dict[str, LoadResult] = {}
    loader = threading.Thread(
        target=lambda: box.setdefault(
            "load",
            run_load(
                edge,
                "double",
                SMALL,
                clients=args.clients,
                duration_s=args.seconds + 2 * MARGIN_S,
                start_delay_s=delay,
            ),
        )
    )
    loader.start()
    time.sleep(delay + MARGIN_S)
    outputs = {name: workdir / f"{name}.txt" for name in targets}
    spies = {
        name: _record(
            py_spy,
            pid,
            outputs[name],
            seconds=args.seconds,
            rate=args.rate,
            gil=args.gil,
            native=args.native,
            blocking=args.blocking,
        )
        for name, pid in targets.items()
    }
    failures = {}
    for name, spy in spies.items():
        try:
            _, stderr = spy.communicate(timeout=args.seconds + 30)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, stderr = spy.communicate()
        if spy.returncode != 0 or not outputs[name].exists() or outputs[name].stat().st_size == 0:
            failures[name] = stderr.decode(errors="replace").strip().splitlines()[-1:] or [
                f"exit {spy.returncode}"
            ]
    loader.join()
    return box["load"], outputs, {name: lines[0] for name, lines in failures.items()}


def _summarise(
    profile: Profile,
    us_per_request: float | None,
    limit: int,
    *,
    sampled_s_per_sample: float,
    requests: float,
) -> dict[str, Any]:
    """The rankings, and the sampled time per request: what the counted samples stand for in
    µs per request (GIL-held time by default), beside the process's CPU per request."""
    sampled = profile.samples * sampled_s_per_sample / requests * 1e6 if requests > 0 else None
    return {
        "samples": profile.samples,
        "waiting_samples_left_out": profile.waiting,
        "cpu_us_per_request": us_per_request,
        "sampled_us_per_request": round(sampled, 1) if sampled is not None else None,
        "threads": top_frames(profile.thread_counts, profile.samples, limit=8, us_per_request=us_per_request),
        "self": top_frames(profile.self_counts, profile.samples, limit=limit, us_per_request=us_per_request),
        "inclusive": top_frames(
            profile.inclusive_counts,
            profile.samples,
            limit=limit,
            us_per_request=us_per_request,
            skip=PLUMBING,
        ),
    }


def _print_profile(name: str, summary: dict[str, Any]) -> None:
    print(
        f"\n== {name}: {summary['samples']} samples ({summary['sampled_us_per_request']} µs sampled/request),"
        f" {summary['cpu_us_per_request']} µs CPU/request"
        + (
            f", {summary['waiting_samples_left_out']} waiting samples left out"
            if summary["waiting_samples_left_out"]
            else ""
        )
    )
    for section in ("threads", "self", "inclusive"):
        print(f"  -- {section} (% of samples, ~µs/request)")
        for row in summary[section]:
            print(f"  {row['percent']:5.1f}%  {row.get('us_per_request', '-'):>6}  {row['frame']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8, help="closed-loop client processes")
    parser.add_argument("--seconds", type=float, default=6.0, help="length of each run / profiled window")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=15, help="frames listed per ranking")
    parser.add_argument(
        "--all-samples", action="store_true", help="py-spy's idle filter instead of GIL-holding samples only"
    )
    parser.add_argument(
        "--native", action="store_true", help="C frames too (uvloop, grpc, zmq); implies --blocking"
    )
    parser.add_argument(
        "--blocking", action="store_true", help="pause each process per sample (exact, slower)"
    )
    args = parser.parse_args()
    seconds = min(max(args.seconds, 1.0), 60.0)
    args.seconds = seconds
    args.blocking = args.blocking or args.native  # py-spy reads native stacks only from a paused process
    args.gil = not (args.all_samples or args.native)
    overrides = {"models": {"known": {"double": {"max_inflight": 4}}}}
    py_spy = _py_spy()
    with running_suite_handle(preload=["double"], overrides=overrides) as suite:
        edge = suite.settings.gateway.edge.bind
        pids = {p.name: p.process.pid for p in suite.processes}
        if suite.redis is not None and suite.redis.process is not None:
            pids["redis"] = suite.redis.process.pid
        time.sleep(SETTLE_S)
        print(f"{args.clients} clients, {seconds:g} s, unprofiled…", flush=True)
        load, cpu = _cpu_run(edge, pids, args.clients, seconds)
        print(f"  {load.throughput:.0f} req/s, {load.errors + load.timeouts} errors", flush=True)
        for name, us in sorted(cpu.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<14} {us:8.1f} µs CPU/request", flush=True)
        targets = {name: pid for name, pid in pids.items() if name.startswith(PROFILED)}
        profiles: dict[str, Any] = {}
        skipped = None
        profiled_rps = None
        if py_spy is None:
            skipped = "py-spy is not installed (requirements-dev.txt; `make install`)"
        else:
            import tempfile

            with tempfile.TemporaryDirectory(prefix="loadmaster-profile-") as tmp:
                print(f"the same load under py-spy ({args.rate} Hz)…", flush=True)
                profiled, outputs, failures = _profiled_run(edge, targets, args, py_spy, Path(tmp))
                profiled_rps = round(profiled.throughput, 1)
                if failures and len(failures) == len(targets):
                    skipped = _why_skipped(failures)
                for name, why in failures.items():
                    profiles[name] = {"error": why}
                stacks = {name: path for name, path in outputs.items() if name not in failures}
                for name, path in stacks.items():
                    profile = parse_collapsed(path.read_text().splitlines(), drop_waiting=args.native)
                    profiles[name] = _summarise(
                        profile,
                        cpu.get(name),
                        args.top,
                        sampled_s_per_sample=1 / args.rate,
                        requests=profiled.throughput * args.seconds,
                    )
                    _print_profile(name, profiles[name])
                _keep_stacks(stacks)
    if skipped:
        print(f"\nprofiles skipped: {skipped}", flush=True)
    path = write_result(
        "profile_data_path",
        {
            "clients": args.clients,
            "seconds": seconds,
            "rate_hz": args.rate,
            "samples": "GIL held" if args.gil else ("all, native, waits left out" if args.native else "all"),
            "native": args.native,
            "throughput_rps": round(load.throughput, 1),
            "throughput_rps_while_profiled": profiled_rps,
            "errors": load.errors + load.timeouts,
            "cpu_us_per_request": cpu,
            "profiles_skipped": skipped,
            "profiles": profiles,
            "tables": {
                f"{name}: top self frames ({'GIL samples' if args.gil else 'all samples'})": [
                    {"frame": row["frame"], "%": row["percent"], "~µs/request": row.get("us_per_request")}
                    for row in summary["self"][:8]
                ]
                for name, summary in profiles.items()
                if "self" in summary
            },
        },
    )
    print(f"wrote {path}")
    return 0


def _why_skipped(failures: dict[str, str]) -> str:
    """One line for py-spy failing on every process, naming ptrace when that is the cause."""
    reasons = "; ".join(f"{name}: {why}" for name, why in failures.items())
    if any(word in reasons.lower() for word in ("permission", "ptrace", "operation not permitted", "root")):
        return f"py-spy could not attach: it needs ptrace (run as root, or kernel.yama.ptrace_scope=0): {reasons}"
    return f"py-spy failed on every process: {reasons}"


def _keep_stacks(stacks: dict[str, Path]) -> None:
    """Copy the collapsed stacks to bench/results/profiles/ when each is small enough."""
    for old in PROFILES.glob("*.txt") if PROFILES.exists() else []:
        old.unlink()
    if not stacks:
        return
    if any(path.stat().st_size > MAX_STACKS_BYTES for path in stacks.values()):
        print(f"collapsed stacks over {MAX_STACKS_BYTES // 1024} KiB: kept only the summary", flush=True)
        return
    PROFILES.mkdir(parents=True, exist_ok=True)
    for name, path in stacks.items():
        shutil.copyfile(path, PROFILES / f"{name}.txt")
    print(f"collapsed stacks in {PROFILES}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
