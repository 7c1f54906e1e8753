"""`Suite.stop()` (what `loadmaster up` runs on Ctrl-C or SIGTERM) with stand-in processes:
one kind at a time in dependency order, each waited for before the next is signalled, what
outlives its grace killed, and the failures returned (`up` exits 1 on them). Metrics goes
last: every other service reports to it until it stops."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from loadmaster.cli.launcher import ServiceProcess, Suite

# A stand-in service: says it is ready, then on SIGTERM writes "term NAME", takes DRAIN_S to
# drain, writes "exit NAME" and exits with CODE; with IGNORE it ignores SIGTERM.
STAND_IN = """
import signal, sys, time
name, code, drain_s, ignore, log = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
def note(word):
    with open(log, "a") as out:
        out.write(f"{word} {name}\\n")
def on_term(*_):
    note("term")
    if ignore:
        return
    time.sleep(drain_s)
    note("exit")
    sys.exit(code)
signal.signal(signal.SIGTERM, on_term)
note("ready")
while True:
    time.sleep(1)
"""


def _stand_in(
    log: Path, name: str, *, code: int = 0, drain_s: float = 0.0, ignore: bool = False
) -> ServiceProcess:
    process = subprocess.Popen(
        [sys.executable, "-c", STAND_IN, name, str(code), str(drain_s), "1" if ignore else "0", str(log)],
        start_new_session=True,
    )
    return ServiceProcess(name, "127.0.0.1:1", process)


def test_stop_goes_gateway_workers_scheduler_broker_metrics_and_reports_failures(tmp_path: Path) -> None:
    grace = {"shutdown_grace_s": 0.5}
    suite = Suite(
        None,
        overrides={s: dict(grace) for s in ("gateway", "model_pool", "scheduler", "metrics", "gpu_broker")},
    )
    log = tmp_path / "events"
    # In the order a running suite may list them after restarts (not the stop order).
    suite.processes = [
        _stand_in(log, "gateway", drain_s=0.3),
        _stand_in(log, "metrics", code=3),
        _stand_in(log, "model-pool-1", drain_s=0.2),
        _stand_in(log, "gpu-broker"),
        _stand_in(log, "scheduler", ignore=True),  # killed once its grace is spent
        _stand_in(log, "model-pool", drain_s=0.2),
    ]
    deadline = time.monotonic() + 30
    while not log.exists() or log.read_text().count("ready") < 6:
        assert time.monotonic() < deadline, "the stand-ins did not start"
        time.sleep(0.02)
    said: list[str] = []
    failed = suite.stop(margin_s=0.2, progress=said.append)
    events = [line for line in log.read_text().splitlines() if not line.startswith("ready")]
    assert events[:2] == ["term gateway", "exit gateway"]  # drained before any worker is told
    assert sorted(events[2:6]) == [
        "exit model-pool",
        "exit model-pool-1",
        "term model-pool",
        "term model-pool-1",
    ]
    assert events[6:] == [
        "term scheduler",
        "term gpu-broker",
        "exit gpu-broker",
        "term metrics",
        "exit metrics",
    ]
    assert failed == ["scheduler", "metrics"]
    assert any("scheduler failed to stop cleanly: did not exit within its grace period" in s for s in said)
    assert any("metrics failed to stop cleanly: exited with code 3" in s for s in said)
    assert not suite.processes
