"""docs/deploy.md's "Three GPU hosts" recipe, step by step, on one machine: three hosts as
network namespaces on a bridge (A 10.77.0.1: Redis with TLS, metrics, scheduler, gateway;
B and C: a gpu-broker for their node and a model-pool each). Every hop between hosts is
encrypted (gRPC TLS, CurveZMQ data ports, Redis TLS) and carries the internal credential.

Robots on host A send requests through the gateway; both workers serve them. Then B's link
is cut and B's processes killed: requests move to C (the time is measured and printed), B's
leases expire, no lease is granted twice (every lease event, read from the broker's Redis
channel), and every request gets a reply.

Needs root and `ip netns` (skips naming what is missing); slow."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import grpc
import httpx
import pytest
import redis
import zmq
from pki import TestCa

from loadmaster.common import internal_auth, transport
from loadmaster.common.child_processes import die_with_parent
from loadmaster.common.credentials import Credentials, Identity
from loadmaster.common.grpc_client import wait_for_health_sync
from loadmaster.v1 import scheduler_pb2, scheduler_pb2_grpc

ROOT = Path(__file__).resolve().parents[3]
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
MODELS = ROOT / "examples" / "models"
ROBOTS = Path(__file__).with_name("robots.py")
SUBNET = "10.77.0"
HOSTS = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2", "c": f"{SUBNET}.3"}
BRIDGE_IP = f"{SUBNET}.254"
PREFIX = "loadmaster:gpu"
# The scheduler notices a worker that went silent (no FIN: a cut link) by gRPC keepalive on its
# session, the gateway its data link to B by ZMTP heartbeats: each within 2 s
# (loadmaster.common.liveness, docs/liveness.md); requests B held are re-granted to C or come
# back `unavailable` (retryable) meanwhile. docs/deploy.md gives the measured time (0-1.23 s);
# this is the ceiling, with margin for a loaded machine.
MOVE_BOUND_S = 5.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=20)


def _netns_unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed"
    probe = f"lmprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        stderr = getattr(error, "stderr", b"") or b""
        return f"`ip netns add` failed: {stderr.decode(errors='replace').strip()}"
    with contextlib.suppress(subprocess.CalledProcessError):
        _run("ip", "netns", "del", probe)
    return ""


@dataclass
class Hosts:
    """The namespaces, the bridge, and every process started in them (stopped in reverse)."""

    tag: str
    base: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def ns(self, host: str) -> str:
        return f"lm{self.tag}{host}"

    @property
    def bridge(self) -> str:
        return f"lmbr{self.tag}"

    def veth(self, host: str) -> str:
        return f"lm{self.tag}{host}0"

    def create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for host, address in HOSTS.items():
            ns, outside = self.ns(host), self.veth(host)
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", f"{outside}p")
            _run("ip", "link", "set", f"{outside}p", "netns", ns)
            _run("ip", "link", "set", outside, "master", self.bridge, "up")
            inside = ("ip", "netns", "exec", ns, "ip")
            _run(*inside, "link", "set", f"{outside}p", "name", "eth0")
            _run(*inside, "addr", "add", f"{address}/24", "dev", "eth0")
            _run(*inside, "link", "set", "eth0", "up")
            _run(*inside, "link", "set", "lo", "up")

    def start(self, host: str, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (self.base / f"{host}-{name}.log").open("ab")
        process = subprocess.Popen(
            die_with_parent(["ip", "netns", "exec", self.ns(host), *command]),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.base / f"host-{host}",
        )
        log.close()
        self.processes[f"{host}-{name}"] = process
        return process

    def kill_host(self, host: str) -> None:
        for label, process in self.processes.items():
            if label.startswith(f"{host}-") and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)
        for host in HOSTS:
            subprocess.run(["ip", "netns", "del", self.ns(host)], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=20)

    def log_tails(self) -> str:
        return "\n".join(
            f"---- {path.name} (tail) ----\n" + "\n".join(path.read_text(errors="replace").splitlines()[-25:])
            for path in sorted(self.base.glob("*.log"))
        )


def _recipe_config() -> str:
    """The shared loadmaster.yaml exactly as docs/deploy.md gives it."""
    text = DEPLOY_DOC.read_text()
    match = re.search(r"<!-- three-hosts-config -->\n```yaml\n(.*?)```", text, re.S)
    assert match, "docs/deploy.md lost its three-hosts config block"
    return match.group(1)


class LeaseEvents:
    """Every lease event the brokers publish on their Redis channel, from before the first grant."""

    def __init__(self, client: redis.Redis) -> None:
        self.events: list[dict[str, object]] = []
        self._pubsub = client.pubsub()
        self._pubsub.subscribe(f"{PREFIX}:events")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if message is not None and message["type"] == "message":
                self.events.append(json.loads(message["data"]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pubsub.close()


def _served(metrics_url: str) -> dict[str, float]:
    """Requests each worker ran (the sum of its batch sizes), by worker id (the `replica`)."""
    counts: dict[str, float] = {}
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith("loadmaster_model_pool_batch_size_sum{"):
            worker = re.search(r'replica="([^"]*)"', line)
            if worker:
                counts[worker.group(1)] = counts.get(worker.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _broker_serving(hosts: Hosts, host: str) -> bool:
    """The recipe's probe, on the host itself: its broker listens on 127.0.0.1 only."""
    probe = subprocess.run(
        ["ip", "netns", "exec", hosts.ns(host), sys.executable, "-m", "loadmaster.common.healthcheck",
         "127.0.0.1:50053", "--tls-ca", str(hosts.base / f"host-{host}" / "tls" / "ca.pem")],
        capture_output=True,
        timeout=20,
    )  # fmt: skip
    return probe.returncode == 0


def _check_hops_are_encrypted_and_credentialed(ca_file: Path, redis_password: str) -> None:
    """What a machine on the hosts' network meets: plaintext is refused on gRPC, on a worker's
    data port and on Redis; TLS without the internal credential is UNAUTHENTICATED."""
    scheduler = f"{HOSTS['a']}:50051"
    request = scheduler_pb2.GetQueuesRequest()
    with grpc.insecure_channel(scheduler) as plain:
        with pytest.raises(grpc.RpcError) as refused:
            scheduler_pb2_grpc.SchedulerServiceStub(plain).GetQueues(request, timeout=3)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS handshake
    with grpc.secure_channel(scheduler, grpc.ssl_channel_credentials(ca_file.read_bytes())) as anonymous:
        with pytest.raises(grpc.RpcError) as refused:
            scheduler_pb2_grpc.SchedulerServiceStub(anonymous).GetQueues(request, timeout=3)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with internal_auth.sync_channel(scheduler) as operator:  # TLS and the credential
        scheduler_pb2_grpc.SchedulerServiceStub(operator).GetQueues(request, timeout=3)
    context = zmq.Context()
    try:
        plain_zmq = context.socket(zmq.DEALER)
        plain_zmq.setsockopt(zmq.LINGER, 0)
        plain_zmq.connect(f"tcp://{HOSTS['c']}:5556")
        plain_zmq.send_multipart([b"", b"not curve"])
        assert not plain_zmq.poll(1000), "a plaintext peer got an answer from a CURVE data port"
        plain_zmq.close()
    finally:
        context.term()
    with pytest.raises(redis.ConnectionError):
        redis.Redis(host=HOSTS["a"], port=6379, password=redis_password, socket_timeout=3).ping()


def _wait(what: str, check: object, timeout_s: float, interval_s: float = 0.25) -> float:
    """Poll `check()` until true; returns the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        with contextlib.suppress(Exception):
            if check():  # type: ignore[operator]
                return time.monotonic() - start
        time.sleep(interval_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")


@pytest.fixture()
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    running = Hosts(tag=str(os.getpid() % 10000), base=tmp_path)
    try:
        running.create()
        yield running
    finally:
        running.stop()
        print(running.log_tails())


def test_three_gpu_hosts_recipe(hosts: Hosts) -> None:
    base = hosts.base
    # Step 1: a CA and a certificate per host (its address and 127.0.0.1).
    (base / "pki").mkdir()
    ca = TestCa(base / "pki")
    # Step 2: one suite secret and one Redis password for all hosts.
    secret, redis_password = secrets.token_hex(32), secrets.token_hex(16)
    # Step 3: the same loadmaster.yaml on every host, under the host's own /etc/loadmaster.
    recipe = _recipe_config()
    for host, address in HOSTS.items():
        etc = base / f"host-{host}"
        (etc / "tls").mkdir(parents=True)
        cert, key = ca.issue(f"host-{host}", [address, "127.0.0.1"])
        shutil.copy(ca.ca_file, etc / "tls" / "ca.pem")
        shutil.copy(cert, etc / "tls" / "host.pem")
        shutil.copy(key, etc / "tls" / "host.key")
        (etc / "internal.secret").write_text(secret + "\n")
        (etc / "internal.secret").chmod(0o600)
        (etc / "models").symlink_to(MODELS)
        config = recipe.replace("/etc/loadmaster", str(etc)).replace("REDIS_PASSWORD", redis_password)
        (etc / "loadmaster.yaml").write_text(config)

    def env(host: str, **overrides: str) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if not k.startswith("LOADMASTER_") and k != "REDIS_URL"}
        return {
            **keep,
            "PYTHONUNBUFFERED": "1",
            "LOADMASTER_CONFIG": str(base / f"host-{host}" / "loadmaster.yaml"),
            **overrides,
        }

    python = sys.executable
    # This process plays the operator on the bridge (10.77.0.254): TLS against the CA, the
    # internal credential, and Redis over TLS.
    transport.setup(transport.Transport(tls_ca=ca.ca_file.read_bytes()))
    internal_auth.setup(Credentials(secret.encode(), Identity("operator", "test")))
    events: LeaseEvents | None = None
    try:
        # Step 4: host A.
        etc_a = base / "host-a"
        hosts.start(
            "a",
            "redis",
            [
                "redis-server", "--port", "0", "--tls-port", "6379", "--bind", HOSTS["a"],
                "--requirepass", redis_password, "--save", "", "--appendonly", "no",
                "--tls-cert-file", str(etc_a / "tls" / "host.pem"), "--tls-key-file", str(etc_a / "tls" / "host.key"),
                "--tls-ca-cert-file", str(etc_a / "tls" / "ca.pem"), "--tls-auth-clients", "no",
            ],
            env("a"),
        )  # fmt: skip
        store = redis.Redis(
            host=HOSTS["a"], port=6379, password=redis_password, ssl=True, ssl_ca_certs=str(ca.ca_file)
        )
        _wait("redis (TLS) on host A", store.ping, 20)
        events = LeaseEvents(store)
        for service in ("metrics", "scheduler", "gateway"):
            hosts.start("a", service, [python, "-m", f"loadmaster.{service}"], env("a"))
        for port in (50054, 50051, 8001):
            wait_for_health_sync(f"{HOSTS['a']}:{port}", timeout_s=90)

        # Step 5: hosts B and C, each a broker for its node and a worker.
        for host in ("b", "c"):
            node, address = f"node-{host}", HOSTS[host]
            declared = json.dumps({node: [{"index": 0, "total_mb": 16384}]})
            hosts.start(
                host,
                "gpu-broker",
                [python, "-m", "loadmaster.gpu_broker"],
                env(host, LOADMASTER_GPU_BROKER__NODE=node, LOADMASTER_GPU_BROKER__DECLARED=declared),
            )
            # The worker registers its node's GPUs through its broker: wait for the broker.
            _wait(f"gpu-broker on host {host}", partial(_broker_serving, hosts, host), 60)
            hosts.start(
                host,
                "model-pool",
                [python, "-m", "loadmaster.model_pool"],
                env(
                    host,
                    LOADMASTER_MODEL_POOL__NODE=node,
                    LOADMASTER_MODEL_POOL__WORKER_ID=f"worker-{host}",
                    LOADMASTER_MODEL_POOL__ADDRESS=f"{address}:50052",
                    LOADMASTER_MODEL_POOL__DATA_BIND=f"tcp://{address}:5556",
                ),
            )
        for host in ("b", "c"):
            wait_for_health_sync(f"{HOSTS[host]}:50052", timeout_s=120)
        _check_hops_are_encrypted_and_credentialed(ca.ca_file, redis_password)

        # Robots on host A, through the gateway's edge.
        stop_file, results = base / "stop-robots", base / "robots.jsonl"
        robots = hosts.start(
            "a",
            "robots",
            [python, str(ROBOTS), "--edge", f"tcp://{HOSTS['a']}:5555", "--robots", "4",
             "--stop-file", str(stop_file), "--out", str(results)],
            env("a"),
        )  # fmt: skip
        metrics_url = f"http://{HOSTS['a']}:8002/metrics"
        _wait(
            "requests served by both worker-b and worker-c",
            lambda: all(_served(metrics_url).get(w, 0) >= 20 for w in ("worker-b", "worker-c")),
            90,
        )
        before_cut = _served(metrics_url)
        print(f"requests per worker before the cut: {before_cut}")

        # Cut B's link, then kill B's processes.
        cut_at = time.time()
        _run("ip", "netns", "exec", hosts.ns("b"), "ip", "link", "set", "eth0", "down")
        time.sleep(8)
        hosts.kill_host("b")

        # B's leases expire (and are reaped by C's broker): no live lease of node-b in Redis.
        def node_b_leases() -> list[str]:
            leases = [store.hgetall(key) for key in store.scan_iter(f"{PREFIX}:lease:*")]
            return [lease[b"id"].decode() for lease in leases if lease.get(b"node") == b"node-b"]

        _wait("node-b's leases expired", lambda: not node_b_leases(), 60)
        time.sleep(3)  # a few more seconds of requests on C alone
        after = _served(metrics_url)
        print(f"requests per worker at the end: {after}")
        assert after["worker-c"] > before_cut["worker-c"]

        stop_file.touch()
        robots.wait(timeout=60)
        records = [json.loads(line) for line in results.read_text().splitlines()]
    finally:
        if events is not None:
            events.close()
        transport.setup(transport.Transport())
        internal_auth.setup(None)

    # Every request got a reply.
    codes: dict[str, int] = {}
    for record in records:
        codes[record["code"]] = codes.get(record["code"], 0) + 1
    print(f"{len(records)} requests, results {codes}")
    assert codes.get("no_reply", 0) == 0, codes
    assert codes.get("wrong_result", 0) == 0, codes
    assert len(records) > 100

    # Requests moved to C: from `moved_s` after the cut on, every request is answered ok
    # within a second. Before it, some wait on B (or fail over with a retryable error).
    slow_or_failed = [
        r
        for r in records
        if r["sent"] >= cut_at - 1 and (r["code"] != "ok" or r["answered"] - r["sent"] > 1.0)
    ]
    moved_s = max((r["answered"] - cut_at for r in slow_or_failed), default=0.0)
    worst = max((r["answered"] - r["sent"] for r in records if r["sent"] >= cut_at - 1), default=0.0)
    print(
        f"requests on C alone {moved_s:.2f}s after B's link was cut "
        f"({len(slow_or_failed)} requests slowed or failed over; slowest reply {worst:.2f}s)"
    )
    assert moved_s <= MOVE_BOUND_S, (moved_s, slow_or_failed[:10])
    assert all(r["code"] == "ok" for r in records if r["sent"] > cut_at + moved_s)

    # Nothing granted twice: each lease acquired once, each fencing token once, and B's
    # leases ended (expired or released).
    acquired = [e["lease"] for e in events.events if e["kind"] == "acquired"]  # type: ignore[index,union-attr]
    assert acquired, "no lease event seen"
    ids = [lease["id"] for lease in acquired]  # type: ignore[index]
    tokens = [lease["token"] for lease in acquired]  # type: ignore[index]
    assert len(ids) == len(set(ids)), ids
    assert len(tokens) == len(set(tokens)), tokens
    b_leases = {lease["id"] for lease in acquired if lease["node"] == "node-b"}  # type: ignore[index]
    b_expired = {
        e["lease"]["id"]: e["ts"]  # type: ignore[index]
        for e in events.events
        if e["kind"] == "expired" and e["lease"]["id"] in b_leases  # type: ignore[index]
    }
    assert b_leases and set(b_expired) == b_leases, (b_leases, b_expired)
    expired_after_s = max(float(ts) / 1000 for ts in b_expired.values()) - cut_at  # type: ignore[arg-type]
    print(
        f"lease events: {len(acquired)} acquired, tokens {sorted(tokens)}; node-b's {len(b_leases)} "
        f"lease(s) expired {expired_after_s:.1f}s after the cut"
    )
    assert expired_after_s < 30
