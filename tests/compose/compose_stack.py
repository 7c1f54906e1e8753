"""Helpers for the compose test: run a command, the project's containers, wait on health."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HEALTH_TIMEOUT_S",
    "PROJECT",
    "ROOT",
    "Container",
    "containers",
    "engine_answers",
    "run",
    "wait_healthy",
]

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "loadmaster"
HEALTH_TIMEOUT_S = 600


def run(
    args: list[str], *, timeout_s: float = 120, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False, env=env
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done


def engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False).returncode == 0


@dataclass(frozen=True, slots=True)
class Container:
    id: str
    name: str
    service: str
    health: str
    ip: str


def containers(all_states: bool = False) -> list[Container]:
    """The project's containers, from `docker inspect` (compose labels, health, network address)."""
    ids = run(
        [
            "docker",
            "ps",
            "-q",
            *(["-a"] if all_states else []),
            "--filter",
            f"label=com.docker.compose.project={PROJECT}",
        ]
    ).stdout.split()
    if not ids:
        return []
    found = []
    for item in json.loads(run(["docker", "inspect", *ids]).stdout):
        state = item["State"]
        health = (
            state.get("Health", {}).get("Status", "none") if state.get("Running") else state.get("Status", "")
        )
        networks = item["NetworkSettings"]["Networks"]
        ip = next((n["IPAddress"] for n in networks.values() if n.get("IPAddress")), "")
        found.append(
            Container(
                item["Id"],
                item["Name"].lstrip("/"),
                item["Config"]["Labels"]["com.docker.compose.service"],
                health,
                ip,
            )
        )
    return found


def wait_healthy(expected: dict[str, int], timeout_s: float = HEALTH_TIMEOUT_S) -> list[Container]:
    """Wait until `expected[service]` containers of each service are running and healthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = [c for c in containers() if c.health == "healthy"]
        counts = {s: sum(c.service == s for c in current) for s in expected}
        if counts == expected:
            return current
        if time.monotonic() > deadline:
            states = [(c.service, c.health) for c in containers(all_states=True)]
            raise AssertionError(f"not healthy after {timeout_s:.0f} s: want {expected}, have {states}")
        time.sleep(2)
