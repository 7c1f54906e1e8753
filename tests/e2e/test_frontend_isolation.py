"""Front ends cannot stall each other (issue 35): 64 MiB gRPC requests in flight while small
requests keep being answered on the edge and on KServe HTTP, and the process that serves the
gRPC front end (`gateway/frontends/grpc_relay.py`) against the real suite.

Behaviour with generous bounds, not speed: every small request is answered right, each small
client is answered several times while the big requests are in flight, and no client waits a
second between answers. bench/gateway_big_request.py measures the speed."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
import zmq
from tritonclient.utils import InferenceServerException

from loadmaster.cli.launcher import Suite
from loadmaster.common.shm import SHM_DIRECTORY
from loadmaster.v1 import edge_pb2, tensor_pb2

MAX_GAP_S = 1.0

# Sends the big requests from a process of its own (its 64 MiB copies hold its own GIL, not the
# small clients'): 16 Mi FP32 through `double` and back, then 64 MiB of BYTES to a model that
# no worker serves. Prints what came back.
_BIG_SENDER = r"""
import json, sys
import grpc
import numpy as np
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2

address = sys.argv[1]
client = triton.InferenceServerClient(address)
x = np.arange(16 << 20, dtype=np.float32)
tensor = triton.InferInput("x", [x.size], "FP32")
tensor.set_data_from_numpy(x)
out = client.infer("double", [tensor], client_timeout=120).as_numpy("x")
doubled = bool(out is not None and out.shape == x.shape and np.array_equal(out, x * 2))
request = service_pb2.ModelInferRequest(model_name="no-such-model")
big = request.inputs.add()
big.name, big.datatype = "x", "BYTES"
big.shape.append(1 << 20)
request.raw_input_contents.append(((60).to_bytes(4, "little") + b"x" * 60) * (1 << 20))
options = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
with grpc.insecure_channel(address, options=options) as channel:
    try:
        channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(request.SerializeToString(), timeout=120)
        unknown = "OK"
    except grpc.RpcError as error:
        unknown = error.code().name
print(json.dumps({"doubled": doubled, "unknown_model": unknown}))
"""


class SmallClient:
    """`double` on 7 floats, again and again, on one front end, in a thread: when each answer
    came and whether it was right."""

    def __init__(self, call: object) -> None:
        self._call = call
        self.answers: list[tuple[float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ok = bool(self._call())  # type: ignore[operator]
            except Exception:
                ok = False
            self.answers.append((time.monotonic(), ok))
            time.sleep(0.01)

    def __enter__(self) -> SmallClient:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def answered_between(self, begin: float, end: float) -> int:
        return sum(1 for at, _ in self.answers if begin <= at <= end)

    def largest_gap_s(self, begin: float, end: float) -> float:
        times = [begin, *(at for at, _ in self.answers if begin <= at <= end), end]
        return max(later - earlier for earlier, later in itertools.pairwise(times))


def _http_double(address: str) -> object:
    client = triton_http.InferenceServerClient(address, network_timeout=30)
    x = np.arange(7, dtype=np.float32)
    tensor = triton_http.InferInput("x", [7], "FP32")
    tensor.set_data_from_numpy(x)
    return lambda: np.array_equal(client.infer("double", [tensor]).as_numpy("x"), x * 2)


def _edge_double(address: str, context: zmq.Context[zmq.Socket[bytes]]) -> object:
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    x = np.arange(7, dtype=np.float32)
    observation = edge_pb2.Observation(
        model_id="double",
        tensors=[tensor_pb2.Tensor(key="x", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[7], byte_length=x.nbytes)],
    )
    observation.client.id = "isolation-test"
    envelope = observation.SerializeToString()

    def call() -> bool:
        dealer.send_multipart([b"", envelope, x.tobytes()])
        if not dealer.poll(30_000):
            return False
        frames = dealer.recv_multipart()
        reply = edge_pb2.ModelResponse.FromString(frames[1])
        return not reply.metadata.get("error_code") and np.array_equal(
            np.frombuffer(frames[2], np.float32), x * 2
        )

    return call


def _relay_processes(suite: Suite) -> list[psutil.Process]:
    service = suite.service("gateway")
    assert service is not None
    children = psutil.Process(service.process.pid).children()
    return [child for child in children if "grpc_relay" in " ".join(child.cmdline())]


def _files_of(pids: set[int]) -> list[str]:
    return [
        path.name for path in SHM_DIRECTORY.glob("loadmaster-grpc-*") if int(path.name.split("-")[2]) in pids
    ]


def test_small_requests_on_other_front_ends_are_answered_while_64_mib_grpc_requests_are_in_flight(
    suite: Suite,
) -> None:
    gateway = suite.settings.gateway
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with (
            SmallClient(_http_double(f"{gateway.http_host}:{gateway.http_port}")) as http,
            SmallClient(_edge_double(gateway.edge.bind, context)) as edge,
        ):
            time.sleep(0.5)
            begin = time.monotonic()
            sent = subprocess.run(
                [sys.executable, "-c", _BIG_SENDER, gateway.address],
                capture_output=True,
                text=True,
                timeout=240,
            )
            end = time.monotonic()
            time.sleep(0.3)
    finally:
        context.destroy(linger=0)
    assert sent.returncode == 0, sent.stderr[-2000:]
    outcome = json.loads(sent.stdout.strip().splitlines()[-1])
    assert outcome == {"doubled": True, "unknown_model": "NOT_FOUND"}
    for name, client in (("http", http), ("edge", edge)):
        assert client.answers and all(ok for _, ok in client.answers), f"{name}: a small request failed"
        assert client.answered_between(begin, end) >= 5, f"{name}: not answered while the big requests ran"
        gap = client.largest_gap_s(begin, end)
        assert gap < MAX_GAP_S, f"{name}: waited {gap:.2f} s for an answer while the big requests ran"
    gateway_service = suite.service("gateway")
    assert gateway_service is not None
    pids = {gateway_service.process.pid, *(relay.pid for relay in _relay_processes(suite))}
    assert _files_of(pids) == [], "shared memory left behind"


def test_a_client_cannot_name_shared_memory(suite: Suite, tmp_path: Path) -> None:
    """A message that looks like the relay's marker is an invalid request, and the file it names
    is left alone."""
    relay = _relay_processes(suite)[0]
    planted = SHM_DIRECTORY / f"loadmaster-grpc-{relay.pid}-{'ab' * 16}"
    planted.write_bytes(b"not for clients")
    try:
        with (
            grpc.insecure_channel(suite.settings.gateway.address) as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(
                b"\x00" + planted.name.encode(), timeout=10
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert planted.read_bytes() == b"not for clients"
    finally:
        planted.unlink(missing_ok=True)


def test_the_grpc_front_end_process_is_started_again_when_it_dies(suite: Suite) -> None:
    (relay,) = _relay_processes(suite)
    gateway = suite.settings.gateway
    http = _http_double(f"{gateway.http_host}:{gateway.http_port}")
    relay.kill()
    relay.wait(10)
    assert http(), "HTTP stops answering when the gRPC front end dies"  # type: ignore[operator]
    deadline = time.monotonic() + 30
    client = triton_grpc.InferenceServerClient(gateway.address)
    live = False
    while not live and time.monotonic() < deadline:
        try:
            live = client.is_server_live(client_timeout=2)
        except InferenceServerException:
            time.sleep(0.2)
    assert live, "the gRPC front end did not come back"
    x = np.ones(3, dtype=np.float32)
    tensor = triton_grpc.InferInput("x", [3], "FP32")
    tensor.set_data_from_numpy(x)
    assert np.array_equal(client.infer("double", [tensor]).as_numpy("x"), x * 2)
    (again,) = _relay_processes(suite)
    assert again.pid != relay.pid
