"""A real Docker engine and the suite under `docker compose` (issue 23).

The engine: the one that answers, else one started here (`dockerd --storage-driver=vfs
--iptables=false --bridge=none`, as root) and stopped after. The images: `make images`. The
stack: `docker compose up -d` (or `docker-compose`, where the compose plugin is missing) with
the project name `loadmaster`; `down -v` at the end whatever happened.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
from compose_stack import HEALTH_TIMEOUT_S, PROJECT, ROOT, containers, engine_answers, run, wait_healthy

IMAGES_TIMEOUT_S = 3600  # a first build on a busy 2-core host with vfs storage


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if engine_answers():
        yield
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None or os.geteuid() != 0:
        pytest.skip("no Docker engine answers, and none can be started here (dockerd missing or not root)")
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [dockerd, "--storage-driver=vfs", "--iptables=false", "--bridge=none"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while not engine_answers():
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"dockerd did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="session")
def compose(docker_engine: None) -> list[str]:
    """The compose command line: the plugin where it answers, else docker-compose (1.29)."""
    if run(["docker", "compose", "version"], check=False).returncode == 0:
        base = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        base = ["docker-compose"]
    else:
        pytest.skip("neither `docker compose` nor docker-compose is installed (make docker-engine)")
    return [
        *base,
        "--project-name",
        PROJECT,
        "--project-directory",
        str(ROOT),
        "-f",
        str(ROOT / "compose.yaml"),
    ]


@pytest.fixture(scope="session")
def images(docker_engine: None) -> float:
    """`make images`; its wall time in seconds (the first build, or a rebuild from cache)."""
    started = time.monotonic()
    done = run(["make", "images"], timeout_s=IMAGES_TIMEOUT_S)
    print(done.stdout[-4000:])
    return time.monotonic() - started


@pytest.fixture(scope="session")
def stack(compose: list[str], images: float) -> Iterator[list[str]]:
    if not (ROOT / "deploy/secrets/internal.secret").exists():
        run(["make", "secrets"])
    run([*compose, "down", "-v", "--remove-orphans"], timeout_s=300, check=False)  # a leftover run
    try:
        started = time.monotonic()
        run([*compose, "up", "-d", "--no-build"], timeout_s=HEALTH_TIMEOUT_S)
        wait_healthy(
            {
                "redis": 1,
                "gpu-broker": 1,
                "metrics": 1,
                "scheduler": 1,
                "model-pool": 1,
                "gateway": 1,
                "balancer": 1,
                "prometheus": 1,
            }
        )
        print(f"compose up: every container healthy after {time.monotonic() - started:.0f} s")
        yield compose
    finally:
        if containers(all_states=True):
            for service in ("gateway", "model-pool", "scheduler", "gpu-broker"):
                print(run([*compose, "logs", "--tail", "30", service], check=False).stdout[-3000:])
        run([*compose, "down", "-v", "--remove-orphans"], timeout_s=300, check=False)
