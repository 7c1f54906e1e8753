"""The admin plane (docs/admin.md, issue 38): what it adds to a request, and how fast a change
reaches another gateway. Writes bench/results/admin_plane.json.

1. Per request, in the process (no sockets): the key check (`Authenticator.authenticate`: hash,
   lookup, expiry, scope, token bucket) and the runtime-settings reads a request makes
   (`models.allow_cloud_fallback`, a tenant's weight) with the admin plane off (the YAML's keys
   and settings) and on (the same request path after the plane installed a stored state: 1000
   stored keys with expiries and rotation graces, stored runtime settings). Target: the plane
   adds < 50 us per request (the lookups are in memory in both cases).
2. Across processes: a real redis-server and two gateway processes. A key is added at gateway A
   (`POST /admin/v1/keys`) and gateway B is asked until it takes the key; then it is revoked at A
   and B is asked until it refuses it. Target: <= 1 s (p99 and worst of `--trials`).

    python bench/admin_plane.py [--trials 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from _harness import percentiles_ms, print_targets, write_result

from loadmaster.cli.redis_server import EmbeddedRedis
from loadmaster.common.admin_store import AdminState
from loadmaster.common.config import Settings
from loadmaster.common.grpc_client import wait_for_health_sync
from loadmaster.common.ports import free_port
from loadmaster.gateway.admin import SchedulerAdmin
from loadmaster.gateway.admin_plane import AdminPlane
from loadmaster.gateway.auth import INFER, Authenticator, hash_key
from loadmaster.gateway.generations import GenerationRouter
from loadmaster.gateway.guardrails import Guardrails
from loadmaster.gateway.keyring import KeyRecord

PER_REQUEST_TARGET_US = 50.0
PROPAGATION_TARGET_MS = 1000.0
KEYS = 1000
CALLS = 20_000
ADMIN_KEY = "lm_bench-admin"


def _settings(keys: int) -> Settings:
    api_keys = [
        {
            "name": f"key-{i}",
            "sha256": hash_key(f"lm_key-{i}"),
            "scopes": ["infer"],
            "rate_per_s": 1e9,
            "tenant": "team",
        }
        for i in range(keys)
    ]
    return Settings.model_validate(
        {
            "gateway": {"auth": {"api_keys": api_keys}},
            "tenants": {"team": {"weight": 2.0}},
            "metrics": {"enabled": False},
        }
    )


async def _per_call_us(run: Any, count: int) -> float:
    started = time.perf_counter()
    for index in range(count):
        await run(index)
    return (time.perf_counter() - started) / count * 1e6


async def per_request() -> dict[str, Any]:
    """Off: the YAML's keys and settings. On: the same after the plane installed a stored state."""
    off_settings = _settings(KEYS)
    off_auth = Authenticator(off_settings.gateway.auth.api_keys)

    async def off_request(i: int) -> None:
        await off_auth.authenticate(f"lm_key-{i % KEYS}", INFER)
        _ = off_settings.models.allow_cloud_fallback
        entry = off_settings.tenants.get("team")
        _ = entry.weight if entry is not None else 1.0

    on_settings = _settings(0)
    on_auth = Authenticator([], required=True)
    plane = AdminPlane(
        on_settings,
        auth=on_auth,
        guardrails=Guardrails(on_settings.gateway.guardrails),
        generations=GenerationRouter(None, _no_models),  # type: ignore[arg-type]  # routes nothing here
        scheduler=SchedulerAdmin("127.0.0.1:1"),
        audit=None,
        gateway_id="bench",
    )
    now = time.time()
    stored_keys = {
        f"key-{i}": KeyRecord(
            name=f"key-{i}",
            sha256=hash_key(f"lm_key-{i}"),
            rate_per_s=1e9,
            tenant="team",
            expires_unix_s=now + 3600,
            grace=[{"sha256": hash_key(f"lm_old-{i}"), "until_unix_s": now + 3600}],  # type: ignore[list-item]
        ).model_dump(mode="json")
        for i in range(KEYS)
    }
    config = {"models.allow_cloud_fallback": False, "tenants.team.weight": 2.0}
    started = time.perf_counter()
    await plane._apply(AdminState(version=1, config=config, keys=stored_keys))
    apply_ms = (time.perf_counter() - started) * 1000

    async def on_request(i: int) -> None:
        await on_auth.authenticate(f"lm_key-{i % KEYS}", INFER)
        _ = plane.settings.models.allow_cloud_fallback
        _ = plane.tenant_weight("team")

    for run in (off_request, on_request):  # warm both
        await _per_call_us(run, 2000)
    off_runs, on_runs = [], []
    for _ in range(5):  # alternated, so drift in machine load hits both alike
        off_runs.append(await _per_call_us(off_request, CALLS))
        on_runs.append(await _per_call_us(on_request, CALLS))
    off_us, on_us = sorted(off_runs)[2], sorted(on_runs)[2]  # medians
    return {
        "keys": KEYS,
        "calls_per_run": CALLS,
        "off_us_per_request": round(off_us, 2),
        "on_us_per_request": round(on_us, 2),
        "added_us_per_request": round(on_us - off_us, 2),
        "apply_state_ms": round(apply_ms, 1),
        "off_runs_us": [round(v, 2) for v in off_runs],
        "on_runs_us": [round(v, 2) for v in on_runs],
    }


async def _no_models() -> dict[str, Any]:
    return {}


def _gateway(folder: Path, name: str, redis_url: str) -> tuple[subprocess.Popen[bytes], str]:
    grpc_port, http_port, edge_port = free_port(), free_port(), free_port()
    config = {
        "log_level": "WARNING",
        "redis_url": redis_url,
        "redis": {"admin_key_prefix": "bench-admin"},
        "metrics": {"enabled": False},
        "scheduler": {"address": f"127.0.0.1:{free_port()}"},
        "gateway": {
            "address": f"127.0.0.1:{grpc_port}",
            "http_port": http_port,
            "edge": {"bind": f"tcp://127.0.0.1:{edge_port}"},
            "auth": {
                "api_keys": [{"name": "ops", "sha256": hash_key(ADMIN_KEY), "scopes": ["infer", "admin"]}]
            },
            "audit": {"path": str(folder / f"{name}-audit.jsonl")},
        },
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOADMASTER_") and k != "REDIS_URL"}
    with (folder / f"{name}.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "loadmaster.gateway", "--config", str(path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_for_health_sync(f"127.0.0.1:{grpc_port}", timeout_s=60)
    return process, f"http://127.0.0.1:{http_port}"


def _until(check: Any, limit_s: float = 10.0) -> float:
    started = time.perf_counter()
    while not check():
        if time.perf_counter() - started > limit_s:
            raise TimeoutError("the change did not arrive within 10 s")
    return time.perf_counter() - started


def propagation(trials: int) -> dict[str, Any]:
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    added_s: list[float] = []
    revoked_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="loadmaster-bench-admin-") as name, EmbeddedRedis() as redis:
        folder = Path(name)
        processes = []
        try:
            process_a, a = _gateway(folder, "a", redis.url)
            processes.append(process_a)
            process_b, b = _gateway(folder, "b", redis.url)
            processes.append(process_b)
            with httpx.Client(timeout=10) as http:

                def status(key: str) -> int:
                    return http.post(
                        f"{b}/v2/models/double/infer", json=body, headers={"Authorization": f"Bearer {key}"}
                    ).status_code

                for trial in range(trials):
                    reply = http.post(f"{a}/admin/v1/keys", json={"name": f"k{trial}"}, headers=admin)
                    reply.raise_for_status()
                    key = reply.json()["key"]
                    added_s.append(_until(lambda key=key: status(key) != 401))  # 503: no scheduler behind
                    http.delete(f"{a}/admin/v1/keys/k{trial}", headers=admin).raise_for_status()
                    revoked_s.append(_until(lambda key=key: status(key) == 401))
        finally:
            for process in processes:
                os.killpg(process.pid, signal.SIGTERM)
            for process in processes:
                process.wait(30)
    return {
        "trials": trials,
        "key_added_to_accepted": percentiles_ms(added_s),
        "key_revoked_to_refused": percentiles_ms(revoked_s),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=30)
    args = parser.parse_args()
    cost = asyncio.run(per_request())
    print(
        f"per request: off {cost['off_us_per_request']} us, on {cost['on_us_per_request']} us, "
        f"added {cost['added_us_per_request']} us; applying a state of {KEYS} keys: {cost['apply_state_ms']} ms"
    )
    spread = propagation(args.trials)
    added, revoked = spread["key_added_to_accepted"], spread["key_revoked_to_refused"]
    print(
        f"key added at A -> accepted at B: p50 {added['p50_ms']} ms, p99 {added['p99_ms']} ms, max {added['max_ms']} ms"
    )
    print(
        f"key revoked at A -> refused at B: p50 {revoked['p50_ms']} ms, p99 {revoked['p99_ms']} ms, max {revoked['max_ms']} ms"
    )
    targets = [
        {
            "name": "admin plane: added per-request cost (key check and settings reads)",
            "measured": cost["added_us_per_request"],
            "target": PER_REQUEST_TARGET_US,
            "unit": "us",
            "met": cost["added_us_per_request"] < PER_REQUEST_TARGET_US,
        },
        {
            "name": "admin plane: key added at one gateway, accepted at another (worst)",
            "measured": added["max_ms"],
            "target": PROPAGATION_TARGET_MS,
            "unit": "ms",
            "met": added["max_ms"] <= PROPAGATION_TARGET_MS,
        },
        {
            "name": "admin plane: key revoked at one gateway, refused at another (worst)",
            "measured": revoked["max_ms"],
            "target": PROPAGATION_TARGET_MS,
            "unit": "ms",
            "met": revoked["max_ms"] <= PROPAGATION_TARGET_MS,
        },
    ]
    path = write_result("admin_plane", {"per_request": cost, "propagation": spread, "targets": targets})
    print_targets(targets, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
