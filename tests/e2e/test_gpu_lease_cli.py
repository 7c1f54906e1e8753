"""`loadmaster gpu status|lease` and `GpuLease` against a real gpu-broker process and real Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from loadmaster.client import AsyncGpuLease, GpuLease, LeaseLostError
from loadmaster.common.errors import ResourceExhaustedError
from loadmaster.common.grpc_client import wait_for_health_sync
from loadmaster.common.ports import free_port
from loadmaster.v1 import gpu_broker_pb2 as pb
from loadmaster.v1 import gpu_broker_pb2_grpc

LOADMASTER = [sys.executable, "-m", "loadmaster.cli.main"]
CONFIG = """
gpu_broker:
  address: 127.0.0.1:{port}
  listen: 127.0.0.1:{port}
  key_prefix: {prefix}
  node: n1
  use_nvml: false
  reserve_mb: 500
  declared:
    n1:
      - {{index: 0, total_mb: 8500, name: fake-a}}
      - {{index: 1, total_mb: 4500, name: fake-b}}
metrics:
  enabled: false
"""


@pytest.fixture(scope="module")
def broker(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A gpu-broker process; yields its config file (GPU 0: 8000 MB leasable, GPU 1: 4000 MB)."""
    port = free_port()
    config = tmp_path_factory.mktemp("gpu-broker") / "loadmaster.yaml"
    config.write_text(CONFIG.format(port=port, prefix=f"e2e-{uuid.uuid4().hex[:8]}"))
    log = (config.parent / "broker.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "loadmaster.gpu_broker", "--config", str(config)],
        env={**os.environ, "REDIS_URL": redis_url},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_health_sync(f"127.0.0.1:{port}", timeout_s=30)
        yield config
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _address(config: Path) -> str:
    return next(line.split()[1] for line in config.read_text().splitlines() if "address:" in line)


def _leases(config: Path) -> list[pb.Lease]:
    with grpc.insecure_channel(_address(config)) as channel:
        stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel)
        return list(stub.ListLeases(pb.ListLeasesRequest(), timeout=5).leases)


def _until(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _gpu(config: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LOADMASTER, "gpu", *args, "--config", str(config)]
        if args[0] == "status"
        else [*LOADMASTER, "gpu", args[0], "--config", str(config), *args[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_status_json_and_table(broker: Path) -> None:
    result = _gpu(broker, "status", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [(g["index"], g["total_mb"], g["reserve_mb"], g["free_mb"]) for g in report["gpus"]] == [
        (0, 8500, 500, 8000),
        (1, 4500, 500, 4000),
    ]
    with GpuLease(mb=3000, address=_address(broker), holder="trainer-7"):
        table = _gpu(broker, "status")
        report = json.loads(_gpu(broker, "status", "--json").stdout)
    assert table.returncode == 0 and "trainer-7" in table.stdout and "fake-a" in table.stdout
    assert report["leases"][0]["holder"] == "trainer-7"
    assert report["gpus"][1]["leased_mb"] == 3000  # best fit: the smaller GPU


def test_lease_runs_the_command_renews_and_releases(broker: Path, tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    script = (
        "import json, os, sys, time; "
        f"json.dump({{k: os.environ.get(k) for k in ('CUDA_VISIBLE_DEVICES', 'CUDA_DEVICE_ORDER', "
        f"'LOADMASTER_GPU_LEASE_ID', 'LOADMASTER_GPU_FENCING_TOKEN')}}, open({str(out)!r}, 'w')); "
        "time.sleep(2.0); sys.exit(7)"
    )
    process = subprocess.Popen(
        [
            *LOADMASTER,
            "gpu",
            "lease",
            "--config",
            str(broker),
            "--mb",
            "5000",
            "--ttl",
            "0.6",
            "--",
            sys.executable,
            "-c",
            script,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    _until(lambda: out.exists() and out.stat().st_size > 0, 30)
    env = json.loads(out.read_text())
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    time.sleep(1.0)  # longer than the TTL: only renewals keep it
    leases = _leases(broker)
    assert [lease.lease_id for lease in leases] == [env["LOADMASTER_GPU_LEASE_ID"]]
    assert leases[0].fencing_token == int(env["LOADMASTER_GPU_FENCING_TOKEN"])
    assert dict(leases[0].mb_per_gpu) == {0: 5000}
    assert process.wait(30) == 7  # the command's exit code
    assert _leases(broker) == []


def test_a_request_that_can_never_fit_exits_at_once_saying_what_is_free(broker: Path) -> None:
    started = time.monotonic()
    result = _gpu(broker, "lease", "--mb", "9000", "--wait", "60", "--", "true")
    assert result.returncode == 1
    assert "can never fit" in result.stderr and "free" in result.stderr and "8000" in result.stderr
    assert time.monotonic() - started < 20
    assert _leases(broker) == []


@pytest.mark.parametrize(
    ("how", "expected"),
    [("sigint", 128 + signal.SIGINT), ("crash", 128 + signal.SIGKILL)],
)
def test_the_lease_is_released_on_ctrl_c_and_on_a_crash(broker: Path, how: str, expected: int) -> None:
    command = (
        "import time; time.sleep(60)"
        if how == "sigint"
        else "import os, signal, time; time.sleep(1.5); os.kill(os.getpid(), signal.SIGKILL)"
    )
    process = subprocess.Popen(
        [
            *LOADMASTER,
            "gpu",
            "lease",
            "--config",
            str(broker),
            "--mb",
            "1000",
            "--",
            sys.executable,
            "-c",
            command,
        ],
        stderr=subprocess.PIPE,
    )
    try:
        _until(lambda: len(_leases(broker)) == 1, 30)
        if how == "sigint":
            # Ctrl-C while the command runs: wait for the CLI to report the lease it holds (the
            # lease shows in the broker a moment before the CLI has the grant).
            assert process.stderr is not None
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                line = process.stderr.readline().decode()
                if line.startswith("lease ") or not line:
                    break
            time.sleep(0.3)  # the command is being started
            process.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the foreground process
        assert process.wait(30) == expected
        assert _leases(broker) == []
    finally:
        if process.poll() is None:
            process.kill()


class _HoldingProxy(gpu_broker_pb2_grpc.GpuBrokerServiceServicer):
    """Forwards to the broker, but holds back the reply to the first Acquire (already granted
    by the broker) until `hold` is set: a grant still in flight when the client is interrupted."""

    def __init__(self, upstream: str) -> None:
        self._channel = grpc.insecure_channel(upstream)
        self._stub = gpu_broker_pb2_grpc.GpuBrokerServiceStub(self._channel)
        self.acquires: list[pb.AcquireRequest] = []
        self.granted = threading.Event()
        self.hold = threading.Event()

    def Acquire(self, request: pb.AcquireRequest, context: grpc.ServicerContext) -> pb.AcquireResponse:  # noqa: N802
        self.acquires.append(request)
        reply = self._stub.Acquire(request, timeout=10)
        if len(self.acquires) == 1:
            self.granted.set()
            self.hold.wait(30)
        return reply

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:  # noqa: N802
        return self._stub.Release(request, timeout=10)

    def Renew(self, request: pb.RenewRequest, context: grpc.ServicerContext) -> pb.RenewResponse:  # noqa: N802
        return self._stub.Renew(request, timeout=10)


@pytest.fixture
def holding_proxy(broker: Path) -> Iterator[tuple[_HoldingProxy, str]]:
    proxy = _HoldingProxy(_address(broker))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    gpu_broker_pb2_grpc.add_GpuBrokerServiceServicer_to_server(proxy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield proxy, f"127.0.0.1:{port}"
    finally:
        proxy.hold.set()
        server.stop(grace=None).wait()
        proxy._channel.close()


def test_ctrl_c_during_acquire_releases_a_grant_that_was_in_flight(
    broker: Path, holding_proxy: tuple[_HoldingProxy, str]
) -> None:
    proxy, address = holding_proxy
    process = subprocess.Popen(
        [*LOADMASTER, "gpu", "lease", "--broker", address, "--mb", "1000", "--", "true"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.granted.wait(30), "the CLI never sent Acquire"
        assert len(_leases(broker)) == 1  # granted by the broker; the CLI has not seen the reply
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 128 + signal.SIGINT
        assert _leases(broker) == []
        # It replayed its Acquire (same client_request_id: the broker answers with the same
        # lease) and released that lease.
        assert [a.client_request_id for a in proxy.acquires] == [proxy.acquires[0].client_request_id] * 2
    finally:
        if process.poll() is None:
            process.kill()


async def test_cancelling_an_async_acquire_in_flight_releases_its_grant(
    broker: Path, holding_proxy: tuple[_HoldingProxy, str]
) -> None:
    import asyncio

    proxy, address = holding_proxy
    entering = asyncio.create_task(AsyncGpuLease(mb=1000, address=address).__aenter__())
    assert await asyncio.to_thread(proxy.granted.wait, 30), "Acquire never reached the broker"
    assert len(_leases(broker)) == 1
    entering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await entering
    assert _leases(broker) == []
    assert (
        len(proxy.acquires) == 2
        and proxy.acquires[1].client_request_id == proxy.acquires[0].client_request_id
    )


def test_gpu_lease_context_manager_renews_releases_and_learns_it_was_lost(broker: Path) -> None:
    address = _address(broker)
    with GpuLease(mb=2000, address=address, ttl_s=0.6, gpus=[1], node="n1") as lease:
        time.sleep(1.0)
        assert [x.lease_id for x in _leases(broker)] == [lease.lease_id]
        assert lease.cuda_visible_devices == "1" and not lease.lost
    assert _leases(broker) == []

    lost: list[Exception] = []
    with GpuLease(mb=2000, address=address, ttl_s=0.6, on_lost=lost.append) as lease:
        with grpc.insecure_channel(address) as channel:  # an operator frees it under the holder
            gpu_broker_pb2_grpc.GpuBrokerServiceStub(channel).Release(
                pb.ReleaseRequest(lease_id=lease.lease_id, fencing_token=lease.fencing_token), timeout=5
            )
        _until(lambda: lease.lost, 5)
    assert len(lost) == 1 and isinstance(lost[0], LeaseLostError)

    with pytest.raises(ResourceExhaustedError, match="free"), GpuLease(mb=20_000, address=address):
        pass


async def test_async_gpu_lease(broker: Path) -> None:
    async with AsyncGpuLease(mb=1500, address=_address(broker), ttl_s=0.6, holder="async-job") as lease:
        import asyncio

        await asyncio.sleep(1.0)
        assert [(x.lease_id, x.holder) for x in _leases(broker)] == [(lease.lease_id, "async-job")]
    assert _leases(broker) == []
