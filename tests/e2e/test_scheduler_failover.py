"""Scheduler failover with real processes (issue 28, item 3; docs/deploy.md "Scheduler failover").

Two schedulers share the leader lease in the embedded Redis; a gateway, a model-pool and a
gpu-broker reach them through one gRPC target listing both. A client sends requests one after
another through the edge while the leader is killed with SIGKILL: every request gets a reply
(errors are replies, and must be retryable `unavailable`); while no scheduler leads, the
gateway serves every request on its last shares (dispatch credits); the standby takes the lease
and serves within 5 s of the kill, and the worker keeps its loaded model (same generation).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import grpc
import numpy as np
import pytest

from loadmaster.cli.launcher import Suite, free_port_overrides, to_env
from loadmaster.client import Connection, NoReplyError
from loadmaster.common.errors import LoadmasterError, UnavailableError
from loadmaster.common.grpc_client import wait_for_health_sync
from loadmaster.common.ports import free_port
from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc

pytestmark = pytest.mark.slow  # a suite of its own with two schedulers (~30 s)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "loadmaster.yaml"
MODEL = "double"
FAILOVER_LIMIT_S = 5.0
MAX_REQUESTS = 20_000  # the load loop's bounds: count and time
LOAD_AFTER_KILL_S = 8.0
PAUSE_S = 0.005  # between one reply and the next request


@dataclass(slots=True)
class Reply:
    sent: float  # time.monotonic()
    answered: float
    error: LoadmasterError | None


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Suite, str, str]]:
    log_dir = tmp_path_factory.mktemp("failover")
    overrides = free_port_overrides()
    first, second = (f"127.0.0.1:{free_port()}" for _ in range(2))
    overrides["scheduler"] = {
        "address": f"ipv4:{first},{second}",  # both schedulers, one gRPC target: pick_first
        "listen": first,
        "leader_lease": {"enabled": True},
    }
    overrides["model_pool"]["preload"] = [MODEL]
    overrides["metrics"]["enabled"] = False
    running = Suite(
        CONFIG,
        overrides=overrides,
        log_dir=log_dir,
        services=("gpu-broker", "scheduler", "model-pool", "gateway"),
    )
    running.start(timeout_s=120)
    standby: subprocess.Popen[bytes] | None = None
    try:
        running.wait_for_models([MODEL], timeout_s=120)
        with standby_log(running).open("ab") as stream:
            standby = subprocess.Popen(
                [sys.executable, "-m", "loadmaster.scheduler", "--config", str(CONFIG)],
                env={**running.env, **to_env({"scheduler": {"listen": second}})},
                stdin=subprocess.DEVNULL,
                stdout=stream,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _wait_for_log(standby_log(running), "standing by", timeout_s=60)
        yield running, first, second
    finally:
        if standby is not None and standby.poll() is None:
            os.killpg(standby.pid, signal.SIGTERM)
            try:
                standby.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(standby.pid, signal.SIGKILL)
                standby.wait()
        running.stop()
        for log in sorted(log_dir.glob("*.log")):
            print(f"---- {log.name} (tail) ----\n" + "\n".join(log.read_text().splitlines()[-25:]))


def _wait_for_log(path: Path, pattern: str, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and re.search(pattern, path.read_text(errors="replace")):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{path.name}: no {pattern!r} within {timeout_s:.0f}s")


def standby_log(running: Suite) -> Path:
    assert running.log_dir is not None
    return running.log_dir / "scheduler-standby.log"


def _log_time(path: Path, message: str) -> float:
    """The UNIX time of the first log record of `path` holding `message`."""
    for line in path.read_text(errors="replace").splitlines():
        if message in line:
            stamp = re.search(r"ts=(\S+)", line)
            assert stamp is not None, line
            return datetime.fromisoformat(stamp.group(1).replace("Z", "+00:00")).timestamp()
    raise AssertionError(f"{path.name}: no {message!r}")


def _generation(worker_address: str) -> int:
    with grpc.insecure_channel(worker_address) as channel:
        reply = model_pool_pb2_grpc.ModelPoolServiceStub(channel).Status(
            model_pool_pb2.StatusRequest(), timeout=5
        )
    return next(m.generation for m in reply.models if m.model_id == MODEL)


def _load(edge: str, stop: threading.Event, replies: list[Reply]) -> None:
    """Requests one after another until `stop` (or the bounds); each outcome recorded."""
    x = np.arange(4, dtype=np.float32)
    with Connection(edge, client_id="failover-load") as conn:
        model = conn.model(MODEL)
        for _ in range(MAX_REQUESTS):
            if stop.is_set():
                return
            sent = time.monotonic()
            try:
                out = model.infer(x=x, timeout_ms=5000)
                np.testing.assert_array_equal(out["x"], 2 * x)
                error = None
            except NoReplyError as missing:  # the one outcome the test refuses
                error = missing
            except LoadmasterError as failed:
                error = failed
            replies.append(Reply(sent, time.monotonic(), error))
            time.sleep(PAUSE_S)


def test_killing_the_leader_under_load_fails_over_within_5s(suite: tuple[Suite, str, str]) -> None:
    running, first, second = suite
    leader = running.service("scheduler")
    assert leader is not None and leader.process.poll() is None
    wait_for_health_sync(first, timeout_s=5)  # the first scheduler leads (the standby does not listen)
    worker_address = running.settings.model_pool.address
    generation = _generation(worker_address)

    replies: list[Reply] = []
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(running.settings.gateway.edge.bind, stop, replies))
    load.start()
    try:
        for _ in range(200):  # steady state first: 50 replies, within 20 s
            if len(replies) >= 50:
                break
            time.sleep(0.1)
        assert replies and all(r.error is None for r in replies), "errors before the kill"
        killed, killed_unix = time.monotonic(), time.time()
        os.killpg(leader.process.pid, signal.SIGKILL)
        leader.process.wait()
        wait_for_health_sync(second, timeout_s=FAILOVER_LIMIT_S + 5)
        running.wait_for_models([MODEL], timeout_s=FAILOVER_LIMIT_S + 5)  # asks the new leader
        time.sleep(max(0.0, LOAD_AFTER_KILL_S - (time.monotonic() - killed)))
    finally:
        stop.set()
        load.join(30)
    assert not load.is_alive()

    lease_taken_s = _log_time(standby_log(running), "leader lease taken") - killed_unix
    standby_serving_s = _log_time(standby_log(running), "serving gRPC on") - killed_unix
    gateway_back_s = _log_time(standby_log(running), 'msg="gateway ') - killed_unix
    worker_back_s = _log_time(standby_log(running), 'msg="worker ') - killed_unix
    after = [r for r in replies if r.sent >= killed]
    errors = [r for r in after if r.error is not None]
    missing = [r for r in replies if isinstance(r.error, NoReplyError)]
    first_error = min((r.sent for r in errors), default=None)
    if first_error is None:
        restored_s = 0.0  # no request failed at all: service never stopped
    else:
        restored = [r for r in after if r.error is None and r.sent > first_error]
        assert restored, "no request succeeded after the kill"
        restored_s = restored[0].answered - killed
    print(
        f"\nscheduler failover, seconds after SIGKILL of the leader: lease taken {lease_taken_s:.2f}, "
        f"standby serving {standby_serving_s:.2f}, gateway connected {gateway_back_s:.2f}, "
        f"worker connected {worker_back_s:.2f}, requests served again {restored_s:.2f}; {len(replies)} requests, "
        f"{len(after)} after the kill, {len(errors)} answered with an error"
        + (f" (sent {errors[0].sent - killed:.2f}..{errors[-1].sent - killed:.2f})" if errors else "")
        + f", {len(missing)} without a reply"
    )
    leaderless = [r for r in after if killed + 0.2 <= r.sent <= killed + lease_taken_s]
    assert not missing, f"{len(missing)} requests got no reply"
    assert leaderless, "no request was sent while no scheduler led"
    failed = [r for r in leaderless if r.error is not None]
    assert not failed, (
        f"{len(failed)} of {len(leaderless)} failed while no scheduler led: the gateway's shares serve"
    )
    assert all(isinstance(r.error, UnavailableError) for r in errors), {type(r.error) for r in errors}
    assert len(errors) <= 0.05 * len(after), f"{len(errors)} of {len(after)} failed: too many"
    assert lease_taken_s < FAILOVER_LIMIT_S
    assert standby_serving_s < FAILOVER_LIMIT_S
    assert max(gateway_back_s, worker_back_s) < FAILOVER_LIMIT_S
    assert restored_s < FAILOVER_LIMIT_S
    assert after[-1].error is None, "still failing at the end of the load"
    assert _generation(worker_address) == generation, "the worker reloaded its model"
