"""The admin plane as an operator uses it: `loadmaster up`, the `loadmaster` verbs with the
suite's admin credential, a second gateway on the same Redis, then `loadmaster up` stopped
and started again on the same config (the embedded Redis keeps its data in redis.data_dir).

Checked: a key added works at both gateways and a revoked one is refused at both (bounded
generously; bench/admin_plane.py measures the delay); keys, guardrails, the strategy, a pin
and `models.allow_cloud_fallback` are the same after the restart; a pin changed as a runtime
setting reaches the worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from loadmaster.cli.launcher import free_port_overrides, to_env
from loadmaster.cli.main import app
from loadmaster.cli.run_state import read_run_state, run_state_path
from loadmaster.common.config import Settings, load_settings
from loadmaster.common.grpc_client import wait_for_health_sync
from loadmaster.common.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "loadmaster.yaml"
LOADMASTER = [sys.executable, "-m", "loadmaster.cli.main"]
INFER = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
BOUND_S = 5.0  # generous; the bench measures the delay
runner = CliRunner()


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example config in a folder of its own (its .loadmaster/ goes there), keys required."""
    folder = tmp_path_factory.mktemp("admin-suite")
    data = yaml.safe_load(EXAMPLE.read_text())
    overrides = free_port_overrides()
    overrides["model_pool"]["preload"] = ["double"]
    data = _merge(data, overrides)
    data["models"]["repository"] = str(ROOT / "examples" / "models")
    data["gateway"]["auth"] = {"required": True}  # no key in the file: only the admin credential acts
    path = folder / "loadmaster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Up:
    """One `loadmaster up` process on `config`."""

    def __init__(self, config: Path, log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("LOADMASTER_")}
        self.settings: Settings = load_settings(config)
        self._log = log.open("ab")
        self.process = subprocess.Popen(
            [*LOADMASTER, "up", "--config", str(config)], env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            wait_for_health_sync(self.settings.gateway.address, timeout_s=120)
            self._wait_ready(config)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, config: Path) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            code, out = cli(config, "models", "list", "--json")
            if code == 0 and any(
                m["model_id"] == "double" and m["state"] == "READY"
                for worker in json.loads(out)["workers"]
                for m in worker["models"]
            ):
                return
            time.sleep(0.2)
        raise TimeoutError("double not READY")

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.settings.gateway.http_port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def cli(config: Path, *args: str) -> tuple[int, str]:
    result = runner.invoke(app, [*args[:2], "--config", str(config), *args[2:]], catch_exceptions=False)
    return result.exit_code, result.output  # stdout and stderr as a terminal shows them


def _second_gateway(up: Up, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A second gateway of the same suite (its own ports), as a compose deployment would run it."""
    # `up` writes its run state once every service is up, which a READY model may precede.
    deadline = time.monotonic() + 30
    while "internal_auth" not in (state := read_run_state(run_state_path(up.settings.gateway.address))):
        assert time.monotonic() < deadline, f"no credentials in the run state of `up`: {state}"
        time.sleep(0.1)
    files = state["internal_auth"]
    http_port = free_port()
    overrides = {
        "gateway": {
            "address": f"127.0.0.1:{free_port()}",
            "http_port": http_port,
            "edge": {"bind": f"tcp://127.0.0.1:{free_port()}"},
            "gr00t": {"bind": f"tcp://127.0.0.1:{free_port()}"},  # (the suite's is taken)
            # Nothing is in flight when the test stops it. A gateway's stop has hung now and then
            # until its grace ran out (30 s, the test's whole wait; issue 35's closing note of 28
            # November): with 10 s such a stop still ends inside the wait.
            "shutdown_grace_s": 10,
        },
        "internal_auth": {"secret_file": files["secret_file"], "admin_token_file": files["admin_token_file"]},
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOADMASTER_")}
    env |= to_env(overrides) | {"REDIS_URL": state["redis_url"]}
    with log.open("ab") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loadmaster.gateway",
                "--config",
                str(up.settings.config_dir / "loadmaster.yaml"),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_for_health_sync(overrides["gateway"]["address"], timeout_s=60)
    return process, f"http://127.0.0.1:{http_port}"


def _status(url: str, key: str) -> int:
    reply = httpx.post(
        f"{url}/v2/models/double/infer", json=INFER, headers={"Authorization": f"Bearer {key}"}, timeout=10
    )
    return reply.status_code


def _within(check: Callable[[], bool], what: str) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < BOUND_S, what
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("admin-logs")
    yield folder
    for log in sorted(folder.glob("*.log")):
        print(
            f"---- {log.name} (tail) ----\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        )


# Slow (make test-all): test_admin_api.py checks the spread across gateways in seconds.
@pytest.mark.slow
def test_changes_reach_every_gateway_and_survive_a_restart_of_up(config: Path, logs: Path) -> None:
    up = Up(config, logs / "up-1.log")
    second: subprocess.Popen[bytes] | None = None
    try:
        second, other = _second_gateway(up, logs / "gateway-2.log")
        assert _status(up.http, "lm_nobody") == 401  # keys are required, and there are none yet

        code, out = cli(config, "keys", "add", "svc", "--tenant", "team", "--weight", "2", "--json")
        assert code == 0, out
        added = json.loads(out)
        assert added["name"] == "svc" and added["key"].startswith("lm_")
        _within(lambda: _status(other, added["key"]) == 200, "the new key did not work at the second gateway")
        assert _status(up.http, added["key"]) == 200

        code, out = cli(config, "keys", "add", "gone", "--json")
        gone = json.loads(out)["key"]
        _within(lambda: _status(other, gone) == 200, "the second key did not reach the second gateway")
        code, out = cli(config, "keys", "revoke", "gone")
        assert code == 0 and "revoked" in out, out
        _within(
            lambda: _status(other, gone) == 401 and _status(up.http, gone) == 401, "the revoked key passed"
        )

        code, out = cli(config, "scheduler", "use", "round_robin")
        assert code == 0 and "-> round_robin" in out and "not stored" not in out, out
        code, out = cli(config, "models", "pin", "double")
        assert code == 0 and "pinned" in out, out
        code, out = cli(config, "config", "set", "models.allow_cloud_fallback", "false")
        assert code == 0 and "true -> false" in out, out
        code, out = cli(config, "guardrails", "add", "--word", "zanzibar", "--json")
        assert code == 0, out
        code, out = cli(config, "config", "set", "tenants.team.weight", "--", "-1")
        assert code == 2 and "tenants.team.weight" in out, out
        code, out = cli(config, "keys", "list", "--json", "--api-key", added["key"])
        assert code == 1 and "lacks the 'admin' scope" in out, out
    finally:
        if second is not None:
            os.killpg(second.pid, signal.SIGTERM)
            second.wait(30)
        up.stop()
    assert up.process.returncode == 0

    again = Up(config, logs / "up-2.log")
    try:
        assert _status(again.http, added["key"]) == 200
        assert _status(again.http, gone) == 401
        code, out = cli(config, "scheduler", "queues", "--json")
        assert code == 0 and json.loads(out)["strategy"] == "round_robin", out
        code, out = cli(config, "models", "list", "--json")
        slots = [
            m for worker in json.loads(out)["workers"] for m in worker["models"] if m["model_id"] == "double"
        ]
        assert slots and all(m["pinned"] for m in slots), out
        code, out = cli(config, "config", "get", "models.allow_cloud_fallback", "--json")
        assert code == 0 and json.loads(out)["value"] is False and json.loads(out)["stored"], out
        code, out = cli(config, "config", "get", "tenants.team.weight", "--json")
        assert json.loads(out)["value"] == 2, out
        code, out = cli(config, "guardrails", "list", "--json")
        assert [r["value"] for r in json.loads(out)["guardrails"]] == ["zanzibar"], out
        code, out = cli(config, "config", "reset", "scheduler.strategy")
        assert code == 0, out
        code, out = cli(config, "scheduler", "queues", "--json")
        assert json.loads(out)["strategy"] == "model_deadline", out

        def pinned() -> bool:
            _, listed = cli(config, "models", "list", "--json")
            return any(
                m["pinned"]
                for w in json.loads(listed)["workers"]
                for m in w["models"]
                if m["model_id"] == "double"
            )

        code, out = cli(config, "config", "set", "models.known.double.pin", "false")  # no call to the worker
        assert code == 0, out
        _within(lambda: not pinned(), "the worker did not take the unpin from the runtime settings")
    finally:
        again.stop()
    started = (logs / "up-2.log").read_text(errors="replace")
    for warning in (
        "models.allow_cloud_fallback: the value set at run time (False) wins over the configuration file's (True)",
        "scheduler.strategy: the value set at run time ('round_robin') wins over the configuration file's",
    ):
        assert warning in started
