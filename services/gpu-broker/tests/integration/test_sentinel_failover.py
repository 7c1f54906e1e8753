"""Redis high availability, for real: a master, two replicas and three Sentinels from Debian's
`redis-server` and `redis-sentinel` packages (`make redis-sentinel` installs them; the test
skips where they are missing), each on a free 127.0.0.1 port with a folder of its own. A
broker on a `redis+sentinel://` URL serves acquire/renew/release traffic from more holders
than the GPUs have room for, while the master is killed (SIGKILL) and Sentinel promotes a
replica. Checked: the broker follows the new master within a bounded time; every request
gets an answer (a grant or a clear error); no memory is promised twice (what the holders
hold, and what ListLeases and Inventory report, never exceed a GPU); every lease a holder
holds is still there after the failover; fencing tokens never repeat, and those of requests
made after the kill exceed every one granted before it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from loadmaster.cli.status import _ping_redis
from loadmaster.common.config import Settings
from loadmaster.common.ports import free_port
from loadmaster.v1 import gpu_broker_pb2 as pb

pytestmark = pytest.mark.slow

MakeSettings = Callable[..., Settings]
StartBroker = Callable[..., Awaitable[Any]]  # conftest.start_broker -> Broker(server, stub)

SERVICE = "loadmaster"
PASSWORD = "sentinel-test-password"
CAPACITY = {0: 10_000, 1: 6_000}  # conftest.DECLARED, node n1
HOLDERS = 20  # x 1000 MB each: more than the 16 slots, so the GPUs stay full
FOLLOW_WITHIN_S = 15.0
_REDIS_SERVER, _REDIS_SENTINEL = "/usr/bin/redis-server", "/usr/bin/redis-sentinel"


@dataclass
class _Node:
    name: str
    port: int
    folder: Path
    process: subprocess.Popen[bytes] | None = None


class SentinelCluster:
    """A master, two replicas and three Sentinels; `close()` kills every process and removes
    every folder, whatever state they are in. Two replicas: with the broker's replica
    acknowledgements on, a master left without any replica grants nothing (UNAVAILABLE), so
    after the kill one replica must remain for the broker to serve without a restart."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="loadmaster-sentinel-"))
        self.servers = [self._node(f"redis-{i}") for i in range(3)]
        self.sentinels = [self._node(f"sentinel-{i}") for i in range(3)]

    def _node(self, name: str) -> _Node:
        folder = self.root / name
        folder.mkdir()
        return _Node(name, free_port(), folder)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://:{PASSWORD}@{hosts}/{SERVICE}/0"

    def start(self, timeout_s: float = 20.0) -> None:
        master = self.servers[0]
        for server in self.servers:
            args = [
                _REDIS_SERVER,
                "--bind",
                "127.0.0.1",
                "--port",
                str(server.port),
                "--dir",
                str(server.folder),
            ]
            args += ["--save", "", "--appendonly", "no", "--requirepass", PASSWORD, "--masterauth", PASSWORD]
            args += ["--repl-diskless-sync-delay", "0", "--daemonize", "no", "--logfile", "redis.log"]
            if server is not master:
                args += ["--replicaof", "127.0.0.1", str(master.port)]
            self._spawn(server, args)
        for sentinel in self.sentinels:
            conf = sentinel.folder / "sentinel.conf"  # Sentinel rewrites its file: one each
            conf.write_text(
                f"bind 127.0.0.1\nport {sentinel.port}\ndir {sentinel.folder}\nlogfile sentinel.log\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 2\n"
                f"sentinel auth-pass {SERVICE} {PASSWORD}\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 4000\n"
            )
            self._spawn(sentinel, [_REDIS_SENTINEL, str(conf)])
        self.wait_until(self.settled, timeout_s, "the Sentinels did not see the replica and each other")

    def _spawn(self, node: _Node, args: list[str]) -> None:
        # setpriv --pdeathsig: the kernel kills the server should pytest itself die (a timeout
        # that skips teardown), so none outlives the test.
        setpriv = shutil.which("setpriv")
        node.process = subprocess.Popen(
            [setpriv, "--pdeathsig", "KILL", "--", *args] if setpriv else args,
            cwd=node.folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def sentinel_client(self, index: int = 0) -> redis.Redis:
        return redis.Redis(port=self.sentinels[index].port, decode_responses=True, socket_timeout=1)

    def master_port(self) -> int:
        """The master's port as the first Sentinel names it."""
        _, port = self.sentinel_client().sentinel_get_master_addr_by_name(SERVICE)
        return int(port)

    def server_on(self, port: int) -> _Node:
        return next(server for server in self.servers if server.port == port)

    def settled(self) -> bool:
        """Every Sentinel knows the two others and the replicas, and the master the first one
        names has every other server as an online replica."""
        try:
            for index in range(len(self.sentinels)):
                client = self.sentinel_client(index)
                if len(client.sentinel_sentinels(SERVICE)) < 2:
                    return False
                if len(client.sentinel_slaves(SERVICE)) < len(self.servers) - 1:
                    return False
            master = redis.Redis(port=self.master_port(), password=PASSWORD, socket_timeout=1)
            info = master.info("replication")
            online = [
                key
                for key, value in info.items()
                if key.startswith("slave") and value.get("state") == "online"
            ]
            return info["role"] == "master" and len(online) == len(self.servers) - 1
        except redis.RedisError:
            return False

    @staticmethod
    def wait_until(check: Callable[[], bool], timeout_s: float, failure: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, failure
            time.sleep(0.1)

    def kill(self, node: _Node) -> None:
        if node.process is not None and node.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait()

    def close(self) -> None:
        for node in [*self.sentinels, *self.servers]:
            self.kill(node)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def cluster() -> Iterator[SentinelCluster]:
    if not (os.access(_REDIS_SERVER, os.X_OK) and os.access(_REDIS_SENTINEL, os.X_OK)):
        pytest.skip("Debian's redis-server and redis-sentinel are not installed (run `make redis-sentinel`)")
    cluster = SentinelCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@dataclass
class _Audit:
    """What the holders were told, and every violation seen (asserted empty at the end)."""

    held: dict[str, pb.Lease] = field(default_factory=dict)  # granted, not yet given back
    token_of: dict[int, str] = field(default_factory=dict)  # fencing token -> lease id
    grants: list[tuple[float, float, int]] = field(default_factory=list)  # (first sent, answered, token)
    answers: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # RPC: code -> count
    violations: list[str] = field(default_factory=list)

    def granted(self, lease: pb.Lease, first_sent: float) -> None:
        self.held[lease.lease_id] = lease
        other = self.token_of.setdefault(lease.fencing_token, lease.lease_id)
        if other != lease.lease_id:
            self.violations.append(f"token {lease.fencing_token} granted to {other} and {lease.lease_id}")
        self.grants.append((first_sent, time.monotonic(), lease.fencing_token))
        for index, capacity in CAPACITY.items():
            promised = sum(held.mb_per_gpu.get(index, 0) for held in self.held.values())
            if promised > capacity:
                self.violations.append(f"holders hold {promised} MB of GPU {index}'s {capacity} MB")

    def answered(self, rpc: str, code: grpc.StatusCode, details: str = "") -> None:
        self.answers[f"{rpc}:{code.name}"] += 1
        clear = code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
        # A release or renew retried after an answer that was lost can find its lease gone.
        clear = clear or (rpc != "acquire" and code == grpc.StatusCode.FAILED_PRECONDITION)
        if not clear or (code != grpc.StatusCode.OK and not details):
            self.violations.append(f"{rpc} answered {code.name}: {details!r}")


async def _call(audit: _Audit, rpc: str, call: Awaitable[Any]) -> tuple[Any, grpc.StatusCode | None]:
    try:
        reply = await call
    except grpc.aio.AioRpcError as error:
        audit.answered(rpc, error.code(), error.details() or "")
        return None, error.code()
    audit.answered(rpc, grpc.StatusCode.OK)
    return reply, None


async def _holder(stub: Any, audit: _Audit, number: int, stop: asyncio.Event) -> None:
    """Acquire 1000 MB, renew, release, again; an UNAVAILABLE answer is retried with the same
    request (its outcome is unknown). Bounded by `stop` and the calls' own deadlines."""
    attempt = 0
    while not stop.is_set():
        attempt += 1
        request = pb.AcquireRequest(holder=f"h{number}", mb=1_000, client_request_id=f"h{number}-{attempt}")
        first_sent, lease = time.monotonic(), None
        for _ in range(200):
            reply, code = await _call(audit, "acquire", stub.Acquire(request, timeout=5))
            if code != grpc.StatusCode.UNAVAILABLE or stop.is_set():
                lease = reply.lease if reply is not None else None
                break
            await asyncio.sleep(0.05)
        if lease is None:
            await asyncio.sleep(0.02)
            continue
        audit.granted(lease, first_sent)
        await asyncio.sleep(0.05)
        renew = pb.RenewRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token)
        await _call(audit, "renew", stub.Renew(renew, timeout=5))
        await asyncio.sleep(0.05)
        del audit.held[lease.lease_id]  # given up before the release is sent
        release = pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token)
        for _ in range(200):
            _, code = await _call(audit, "release", stub.Release(release, timeout=5))
            if code != grpc.StatusCode.UNAVAILABLE:
                break
            await asyncio.sleep(0.05)


async def _watch_capacity(stub: Any, audit: _Audit, stop: asyncio.Event) -> int:
    """What the broker reports, every 100 ms: live leases and leased MB per GPU within capacity.
    Returns how many reports it checked."""
    checked = 0
    while not stop.is_set():
        with contextlib.suppress(grpc.aio.AioRpcError):  # UNAVAILABLE while Redis fails over
            leases = (await stub.ListLeases(pb.ListLeasesRequest(), timeout=5)).leases
            gpus = (await stub.Inventory(pb.InventoryRequest(), timeout=5)).gpus
            for index, capacity in CAPACITY.items():
                listed = sum(lease.mb_per_gpu.get(index, 0) for lease in leases)
                if listed > capacity:
                    audit.violations.append(f"ListLeases: {listed} MB on GPU {index} of {capacity}")
            for gpu in gpus:
                if gpu.leased_mb + gpu.used_outside_mb > gpu.total_mb - gpu.reserve_mb:
                    audit.violations.append(f"Inventory: GPU {gpu.index} leased {gpu.leased_mb} MB")
            checked += 1
        await asyncio.sleep(0.1)
    return checked


async def _leases_survived(stub: Any, audit: _Audit) -> None:
    """Every lease a holder holds now is one the broker lists (none vanished in a failover)."""
    holding = dict(audit.held)
    for _ in range(50):  # UNAVAILABLE while the new master's replica resyncs: a few seconds at most
        try:
            listed = {
                lease.lease_id for lease in (await stub.ListLeases(pb.ListLeasesRequest(), timeout=5)).leases
            }
            break
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            await asyncio.sleep(0.1)
    else:
        raise AssertionError("ListLeases was not served within 5 s")
    lost = [lease_id for lease_id in holding if lease_id not in listed and lease_id in audit.held]
    assert not lost, f"granted leases lost in the failover: {lost}"


async def _followed(audit: _Audit, since: float, timeout_s: float) -> float:
    """Seconds from `since` to the first grant of a request first sent after it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answered = [done for sent, done, _ in audit.grants if sent > since]
        if answered:
            return min(answered) - since
        await asyncio.sleep(0.05)
    raise AssertionError(
        f"the broker did not follow the new master within {timeout_s} s: {dict(audit.answers)}"
    )


def _tokens_rise(audit: _Audit, since: float) -> None:
    before = [token for _, done, token in audit.grants if done <= since]
    after = [token for sent, _, token in audit.grants if sent > since]
    assert before and after
    assert min(after) > max(before), (
        f"a token after the failover ({min(after)}) <= one before ({max(before)})"
    )


async def test_the_broker_follows_sentinel_failovers_under_lease_traffic(
    cluster: SentinelCluster, make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    started = time.monotonic()
    row = await asyncio.to_thread(_ping_redis, cluster.url, 2.0)  # `loadmaster status` follows it too
    assert row.reachable and PASSWORD not in row.url, row
    broker = await start_broker(make_settings(redis=cluster.url, lease_ttl_s=30.0))
    audit, stop = _Audit(), asyncio.Event()
    holders = [asyncio.create_task(_holder(broker.stub, audit, n, stop)) for n in range(HOLDERS)]
    watcher = asyncio.create_task(_watch_capacity(broker.stub, audit, stop))
    try:
        await asyncio.sleep(3.0)
        master = cluster.master_port()
        killed = time.monotonic()
        cluster.kill(cluster.server_on(master))  # SIGKILL: Sentinel promotes a replica
        follow_s = await _followed(audit, killed, FOLLOW_WITHIN_S)
        await asyncio.to_thread(
            cluster.wait_until, lambda: cluster.master_port() != master, 10, "no new master"
        )
        await asyncio.sleep(2.0)
        await _leases_survived(broker.stub, audit)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*holders, watcher, return_exceptions=True), 15)
    assert not [task.exception() for task in [*holders, watcher] if task.exception()]

    print(f"\nfirst grant {follow_s:.2f} s after the kill; answers: {dict(audit.answers)}")
    assert not audit.violations, audit.violations[:10]
    assert watcher.result() > 20  # the capacity audit ran throughout
    _tokens_rise(audit, killed)
    assert audit.answers["acquire:OK"] > 50 and audit.answers["release:OK"] > 50
    assert time.monotonic() - started < 60


async def test_after_a_switch_over_the_broker_moves_to_the_demoted_masters_successor(
    cluster: SentinelCluster, make_settings: MakeSettings, start_broker: StartBroker
) -> None:
    """SENTINEL FAILOVER demotes a live master (and closes its clients' connections; a
    demotion that leaves them open is `test_replica_acks.py`'s READONLY test): the broker
    reaches the new master at once, and the lease granted before is still there."""
    broker = await start_broker(make_settings(redis=cluster.url))
    held = (await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=1_000), timeout=5)).lease
    master = cluster.master_port()
    assert cluster.sentinel_client().sentinel_failover(SERVICE)
    await asyncio.to_thread(cluster.wait_until, lambda: cluster.master_port() != master, 15, "no new master")
    await asyncio.to_thread(cluster.wait_until, cluster.settled, 20, "the old master did not rejoin")
    assert redis.Redis(port=master, password=PASSWORD).info("replication")["role"] == "slave"

    deadline, answers = time.monotonic() + 5.0, []
    while True:
        try:
            lease = (await broker.stub.Acquire(pb.AcquireRequest(holder="w", mb=1_000), timeout=5)).lease
            break
        except grpc.aio.AioRpcError as error:
            answers.append(f"{error.code().name}: {error.details()}")
            assert error.code() == grpc.StatusCode.UNAVAILABLE, answers
            assert time.monotonic() < deadline, f"still not served after 5 s: {answers[-3:]}"
            await asyncio.sleep(0.1)
    assert len(answers) <= 3, answers  # at most the connection lost to the old master
    assert lease.fencing_token > held.fencing_token
    renewed = await broker.stub.Renew(
        pb.RenewRequest(lease_id=held.lease_id, fencing_token=held.fencing_token), timeout=5
    )
    assert renewed.lease.lease_id == held.lease_id  # acknowledged before the switch: still there
