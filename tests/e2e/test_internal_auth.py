"""Issue 25, Deliver 5, as real processes: a service refuses to bind beyond loopback without
internal auth, and the suite `loadmaster up` starts makes a secret its children require."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from loadmaster.cli.launcher import Suite, free_port_overrides, to_env
from loadmaster.common import internal_auth
from loadmaster.common.config import load_settings
from loadmaster.common.credentials import Identity
from loadmaster.common.ports import free_port
from loadmaster.v1 import scheduler_pb2, scheduler_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def _scheduler_env(**overrides: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOADMASTER_")}
    env.update(to_env({"metrics": {"enabled": False}, **overrides}))
    return env


def test_a_service_bound_beyond_loopback_without_auth_refuses_to_start() -> None:
    address = f"0.0.0.0:{free_port()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "loadmaster.scheduler"],
        env=_scheduler_env(scheduler={"address": address}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"the scheduler kept running on {address} without internal auth")
    text = output.decode(errors="replace")
    assert process.returncode == 2, text
    assert f"scheduler: refusing to listen on {address} without internal auth" in text, text
    assert "internal_auth.insecure: true" in text, text  # the message says how to proceed


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "loadmaster.yaml"
    path.write_text("scheduler:\n  strategy: model_deadline\nmetrics:\n  enabled: false\n")
    return path


def test_up_makes_a_secret_that_its_children_require(config: Path, tmp_path: Path) -> None:
    suite = Suite(
        config,
        overrides=free_port_overrides(),
        services=("scheduler",),
        log_dir=tmp_path / "logs",
        make_credentials=True,
    )
    secret_file = config.parent / internal_auth.RUN_DIR / "internal.secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert len(bytes.fromhex(secret_file.read_text().strip())) == 32
    suite.start(timeout_s=60)
    try:
        address = suite.settings.scheduler.address
        request = scheduler_pb2.SetStrategyRequest(strategy="round_robin")
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            scheduler_pb2_grpc.SchedulerServiceStub(channel).SetStrategy(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # The CLI, run with the same config, finds the secret and the admin token up made.
        internal_auth.setup_client(load_settings(config), Identity("cli", "test"))
        try:
            with internal_auth.sync_channel(address) as channel:
                reply = scheduler_pb2_grpc.SchedulerServiceStub(channel).SetStrategy(request, timeout=10)
        finally:
            internal_auth.setup(None)
        assert reply.previous == "model_deadline"
    finally:
        suite.stop()
    log = (tmp_path / "logs" / "scheduler.log").read_text()
    assert "refused /loadmaster.v1.SchedulerService/SetStrategy from ipv4:127.0.0.1" in log, log
