"""Training and inference share one declared GPU (issue 21 item 5, docs/vram-gate.md).

One GPU x 1000 MB. The worker holds `idle` (300 MB, priority 0) warm. A training job,
`loadmaster gpu lease --mb 600 -- CMD`, holds 600 MB. A request for `big` (800 MB) cannot be
served: even evicting `idle` would leave 700 MB. It waits behind the VRAM gate instead of
failing, and a request with a short deadline gets a fast 504 that says it waited for memory.
When the training command exits, the waiting request is served (`idle`, of lower priority,
is evicted for it). All along, a thread audits the broker's Redis state: no moment has more
memory promised than the card has.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from loadmaster.cli.launcher import Suite, free_port_overrides

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"
TOTAL_MB = 1000
MODEL = """
import numpy as np

class Double:
    def infer(self, inputs):
        return {"y": inputs["x"] * np.float32(2)}
"""


@pytest.fixture(scope="module")
def shared_gpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    repo = tmp_path_factory.mktemp("sharing-models")
    for name in ("big", "idle"):
        (repo / name).mkdir()
        (repo / name / "config.yaml").write_text(
            "backend: python\nclass: Double\ninputs:\n  - {name: x, dtype: float32}\n"
        )
        (repo / name / "model.py").write_text(MODEL)
    overrides = free_port_overrides()
    overrides["gpu_broker"].update(
        {"reserve_mb": 0, "declared": {"local": [{"index": 0, "total_mb": TOTAL_MB, "name": "declared"}]}}
    )
    overrides["model_pool"].update({"preload": ["idle"], "eviction_wait_s": 1})
    overrides["scheduler"] = {
        **overrides["scheduler"],
        "request_ttl_ms": 60_000,
        "vram_gate_retry_ms": 300,
    }
    overrides["models"] = {
        "repository": str(repo),
        "defaults": {"min_resident_s": 0},
        "known": {"big": {"vram_mb": 800, "priority": 1}, "idle": {"vram_mb": 300, "priority": 0}},
    }
    log_dir = tmp_path_factory.mktemp("sharing-logs")
    suite = Suite(EXAMPLE_CONFIG, overrides=overrides, log_dir=log_dir)
    suite.start(timeout_s=120)
    try:
        suite.wait_for_models(["idle"], timeout_s=60)
        yield suite
    finally:
        suite.stop()
        for log in sorted(log_dir.glob("*.log")):
            if log.name.startswith(("model-pool", "scheduler")):
                print(f"---- {log.name} (tail) ----\n" + "\n".join(log.read_text().splitlines()[-25:]))


class BrokerAudit(threading.Thread):
    """Audits the broker's Redis state two ways. Every 10 ms it reads a snapshot: per GPU, the
    leases' MB (from each lease hash) and the GPU hash's own count must both stay within the
    card. And it replays the broker's event channel, which every script publishes to from
    inside the script (the exact serial history of the books): after each event, the MB
    booked on GPU 0 must stay within the card. So no moment between samples escapes."""

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__(daemon=True)
        self._redis = redis.Redis.from_url(url, decode_responses=True)
        self._prefix = prefix
        self._done = threading.Event()
        self.samples = 0
        self.events: list[dict[str, Any]] = []
        self.max_promised_mb = 0
        self.holders_seen: set[str] = set()
        self.violations: list[str] = []
        self._listener = self._redis.pubsub()
        self._listener.subscribe(f"{prefix}:events")
        assert self._listener.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
        self._booked = self.sample()  # the books when the replay starts (idle: nothing moves)

    def run(self) -> None:
        while not self._done.is_set():
            try:
                self.sample()
                while (message := self._listener.get_message(timeout=0.01)) is not None:
                    if message["type"] == "message":
                        self.replay(json.loads(message["data"]))
            except redis.RedisError as error:  # the suite is stopping
                self.violations.append(f"redis: {error}")
                return

    def replay(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        sign = {"acquired": 1, "released": -1, "expired": -1}.get(str(event["kind"]), 0)
        for part in str(event["lease"]["alloc"]).split(","):
            index, _, mb = part.partition("=")
            if index == "0" and mb:
                self._booked += sign * int(mb)
        self.max_promised_mb = max(self.max_promised_mb, self._booked)
        if self._booked > TOTAL_MB:
            self.violations.append(f"after a {event['kind']} event: {self._booked} MB booked")

    def sample(self) -> int:
        gpu_key = f"{self._prefix}:gpu:local:0"
        with self._redis.pipeline(transaction=True) as pipe:  # one consistent snapshot (MULTI)
            pipe.hgetall(gpu_key)
            pipe.keys(f"{self._prefix}:lease:*")
            gpu, lease_keys = pipe.execute()
        leases = []
        if lease_keys:
            with self._redis.pipeline(transaction=True) as pipe:
                for key in lease_keys:
                    pipe.hgetall(key)
                leases = [lease for lease in pipe.execute() if lease]
        by_leases = 0
        for lease in leases:
            self.holders_seen.add(json.loads(lease.get("labels") or "{}").get("model", "training"))
            for part in lease.get("alloc", "").split(","):
                index, _, mb = part.partition("=")
                if index == "0" and mb:
                    by_leases += int(mb)
        counted = int(gpu.get("leased_mb", 0)) + int(gpu.get("used_outside_mb", 0))
        limit = int(gpu.get("total_mb", TOTAL_MB)) - int(gpu.get("reserve_mb", 0))
        self.samples += 1
        self.max_promised_mb = max(self.max_promised_mb, by_leases, counted)
        if by_leases > TOTAL_MB or counted > limit or limit > TOTAL_MB:
            self.violations.append(f"{by_leases} MB in leases, {counted} MB counted, limit {limit}")
        return by_leases

    def stop(self) -> None:
        self._done.set()
        self.join(5)
        self._listener.close()


def _infer(http: str, model: str, value: float, *, timeout_us: int | None = None) -> httpx.Response:
    body: dict[str, Any] = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [value]}]}
    if timeout_us is not None:
        body["parameters"] = {"timeout": timeout_us}
    return httpx.post(f"http://{http}/v2/models/{model}/infer", json=body, timeout=90)


def _state(http: str, model: str) -> bool:
    return httpx.get(f"http://{http}/v2/models/{model}/ready", timeout=5).status_code == 200


# Slow (make test-all): the broker's test_waiting.py checks a lease waiting for memory to free.
@pytest.mark.slow
def test_a_load_waits_for_a_training_job_and_is_served_when_it_ends(
    shared_gpu: Suite, tmp_path: Path
) -> None:
    settings = shared_gpu.settings
    http = f"{settings.gateway.http_host}:{settings.gateway.http_port}"
    audit = BrokerAudit(settings.redis_url or "", settings.gpu_broker.key_prefix)
    audit.start()
    release = tmp_path / "training-done"
    started = tmp_path / "training-started"
    wait_for_file = (
        "import pathlib, time\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        f"while not pathlib.Path({str(release)!r}).exists(): time.sleep(0.05)\n"
    )
    lease = ["gpu", "lease", "--broker", settings.gpu_broker.address, "--mb", "600"]
    training = subprocess.Popen(
        [sys.executable, "-m", "loadmaster.cli.main", *lease, "--", sys.executable, "-c", wait_for_file],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert training.poll() is None, training.stdout.read() if training.stdout else ""
            assert time.monotonic() < deadline, "the training command never started"
            time.sleep(0.05)

        # A caller with a short deadline: a fast, clear 504, not a hung call.
        t0 = time.monotonic()
        hurried = _infer(http, "big", 1.0, timeout_us=1_500_000)
        took = time.monotonic() - t0
        assert hurried.status_code == 504, hurried.text
        assert "waiting for GPU memory" in hurried.text, hurried.text
        assert took < 10, f"a 1.5 s deadline answered after {took:.1f} s"

        # A patient caller waits behind the VRAM gate...
        answers: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: answers.append(_infer(http, "big", 21.0)))
        waiting.start()
        time.sleep(2.0)  # several gate retries (every 0.3 s) find no memory
        assert waiting.is_alive() and not answers, "the request was answered while the job held memory"
        assert _state(http, "idle"), "idle was evicted although that could not make room"

        # ...and is served once the training job exits.
        release.touch()
        assert training.wait(30) == 0
        waiting.join(60)
        assert answers, "the waiting request was never answered"
        reply = answers[0]
        assert reply.status_code == 200, reply.text
        assert reply.json()["outputs"][0]["data"] == [42.0]
        assert not _state(http, "idle"), "idle (priority 0) should have been evicted for big"
    finally:
        release.touch()
        if training.poll() is None:
            training.kill()
            training.wait(10)
        audit.stop()
    assert audit.samples > 50
    kinds = [(e["kind"], json.loads(e["lease"].get("labels") or "{}").get("model")) for e in audit.events]
    assert ("acquired", "big") in kinds and ("released", None) in kinds  # big's grant, the job's release
    assert not audit.violations, audit.violations[:5]
    assert {"big", "idle", "training"} <= audit.holders_seen  # the audit saw all three holders
    assert audit.max_promised_mb <= TOTAL_MB
