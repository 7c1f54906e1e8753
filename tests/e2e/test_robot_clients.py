"""Robots as they are, against the running suite: openpi's stock client (openpi-client from
PyPI, run in .venv-openpi: it pins numpy < 2), a GR00T client written from GR00T's protocol,
and Inferential-protocol observations carrying JPEG and PNG camera frames."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import simplejpeg
import zmq
from gr00t_protocol import Gr00tClient, pack, unpack
from PIL import Image

from loadmaster.cli.launcher import Suite, free_port_overrides
from loadmaster.v1 import edge_pb2, metrics_pb2, metrics_pb2_grpc, tensor_pb2

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "examples" / "loadmaster.yaml"
OPENPI_PYTHON = ROOT / ".venv-openpi" / "bin" / "python"
OPENPI_ROBOT = Path(__file__).resolve().parent / "robots" / "openpi_robot.py"
TIMEOUT_S = 60


def _openpi_missing() -> str:
    """Why the stock openpi client cannot run here, or "". Only an environment `make openpi`
    could not make is a reason to skip: one it made whose client does not import is a
    failure (a missing dependency once hid every openpi test on a fresh machine)."""
    if not (OPENPI_PYTHON.parent.parent / ".installed").exists():
        return "no .venv-openpi: `make openpi` makes it (openpi-client pins numpy < 2)"
    check = subprocess.run(
        [str(OPENPI_PYTHON), "-c", "import openpi_client.websocket_client_policy"],
        capture_output=True,
        timeout=60,
    )
    assert check.returncode == 0, f"openpi-client does not import: {check.stderr.decode()[-300:]}"
    return ""


_OPENPI_MISSING = _openpi_missing()
needs_openpi = pytest.mark.skipif(bool(_OPENPI_MISSING), reason=_OPENPI_MISSING or "ready")


def _url(suite: Suite, model: str, query: str = "") -> str:
    gateway = suite.settings.gateway
    return f"ws://{gateway.http_host}:{gateway.http_port}/openpi/{model}{query}"


def _robot(*args: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    done = subprocess.run(
        [str(OPENPI_PYTHON), str(OPENPI_ROBOT), *args], capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


ROBOT_KEY = "lm_robots-0123456789abcdefghijklmnopqrstuv"


@pytest.fixture(scope="module")
def keyed_suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    """A second suite for this module: API keys on, and GR00T serving `sleep` (4 at a time), so
    edge, openpi and GR00T clients contend for one model."""
    overrides = free_port_overrides()
    overrides["gateway"]["gr00t"]["model"] = "sleep"
    overrides["gateway"]["auth"] = {
        "api_keys": [{"name": "robots", "sha256": hashlib.sha256(ROBOT_KEY.encode()).hexdigest()}]
    }
    overrides["model_pool"]["preload"] = ["sleep"]
    running = Suite(EXAMPLE_CONFIG, overrides=overrides, log_dir=tmp_path_factory.mktemp("keyed-suite"))
    running.start(timeout_s=120)
    try:
        running.wait_for_models(["sleep"], timeout_s=120)
        yield running
    finally:
        running.stop()


@pytest.fixture()
def gr00t(suite: Suite) -> Iterator[Gr00tClient]:
    client = Gr00tClient(suite.settings.gateway.gr00t.bind)
    yield client
    client.close()


# ---- openpi ----------------------------------------------------------------------------


@needs_openpi
def test_openpi_stock_client_gets_metadata_and_the_policys_actions(
    suite: Suite, models_dir: Path, tmp_path: Path
) -> None:
    reference = np.load(models_dir / "policy" / "artifacts" / "reference.npz")
    state = reference["input.state"][:1]  # [1, 32]: the model's own batch axis
    np.save(tmp_path / "state.npy", state)
    result = _robot(_url(suite, "policy"), "infer", str(tmp_path / "state.npy"), str(tmp_path / "action.npy"))
    metadata = result["metadata"]
    assert metadata["server"] == "loadmaster" and metadata["model"] == "policy"
    assert metadata["inputs"] == [{"name": "state", "datatype": "FP32", "shape": [-1, 32]}]
    assert metadata["outputs"] == [{"name": "action", "datatype": "FP32", "shape": [-1, 8]}]
    assert result["server_timing"]["infer_ms"] >= 0
    action = np.load(tmp_path / "action.npy")
    np.testing.assert_allclose(action, reference["output.action"][:1], rtol=1e-5, atol=1e-6)
    # one observation without the batch axis: added for the model, removed from the action
    np.save(tmp_path / "state.npy", state[0].astype(np.float64))  # float64: cast to float32
    _robot(_url(suite, "policy"), "infer", str(tmp_path / "state.npy"), str(tmp_path / "action.npy"))
    single = np.load(tmp_path / "action.npy")
    assert single.shape == (8,)
    np.testing.assert_allclose(single, reference["output.action"][0], rtol=1e-5, atol=1e-6)


@needs_openpi
def test_openpi_errors_are_a_text_frame_then_a_close(suite: Suite) -> None:
    result = _robot(_url(suite, "policy"), "error")
    assert "tensor 'prompt' is not an input of model 'policy'" in result["error"]
    assert result["close_code"] == 1011


def test_openpi_handshake_refuses_bad_query_parameters_and_unknown_models(suite: Suite) -> None:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    for query, status, named in [
        ("?priority=high", 400, "priority"),
        ("?urgency=2", 400, "urgency"),
        ("?deadline_ms=0", 400, "deadline_ms"),
        ("?temperature=1", 400, "temperature"),
    ]:
        with pytest.raises(InvalidStatus) as refused:
            connect(_url(suite, "policy", query), open_timeout=10)
        assert refused.value.response.status_code == status
        assert named in refused.value.response.body.decode()
    with pytest.raises(InvalidStatus) as missing:
        connect(_url(suite, "no-such-model"), open_timeout=10)
    assert missing.value.response.status_code == 404
    with connect(_url(suite, "policy", "?priority=0&urgency=0.5&deadline_ms=2000&client_id=arm-7")) as ok:
        assert ok.recv(timeout=10)  # the metadata frame


@needs_openpi
def test_eight_openpi_robots_on_one_policy_are_batched_together(suite: Suite) -> None:
    robots, calls = 8, 15
    result = _robot(_url(suite, "slow-policy"), "fleet", str(robots), str(calls), timeout_s=120)
    assert result["failures"] == []
    assert result["calls"] == robots * calls
    served_in_turn_s = robots * calls * 0.010  # the model sleeps 10 ms per call
    assert result["seconds"] < 0.75 * served_in_turn_s, result
    assert _stat(suite, "batch_size", {"model": "slow-policy"}, at_least=4.0) >= 4.0


def _stat(suite: Suite, name: str, labels: dict[str, str], *, at_least: float) -> float:
    """The largest value of a series in the metrics service (waits for reports to arrive)."""
    deadline = time.monotonic() + 15
    largest = 0.0
    while time.monotonic() < deadline:
        with grpc.insecure_channel(suite.settings.metrics.address) as channel:
            stub = metrics_pb2_grpc.MetricsServiceStub(channel)
            reply = stub.GetStats(metrics_pb2.GetStatsRequest(name=name, labels=labels), timeout=5)
        largest = reply.stats.max
        if largest >= at_least:
            break
        time.sleep(0.2)
    return largest


# ---- GR00T -------------------------------------------------------------------------------


def test_gr00t_ping_modality_config_reset_and_kill(gr00t: Gr00tClient) -> None:
    assert gr00t.ping() == {"status": "ok", "message": "Server is running"}
    config = gr00t.get_modality_config()
    assert config["state"] == {
        "__ModalityConfig_class__": True,
        "as_json": {"delta_indices": [0], "modality_keys": ["state"]},
    }
    assert set(config) == {"state", "action"}
    assert gr00t.reset() == {}
    with pytest.raises(RuntimeError, match="'kill' is refused"):
        gr00t.kill_server()
    assert gr00t.ping()["status"] == "ok"  # still serving


def test_gr00t_get_action_matches_the_policy(gr00t: Gr00tClient, models_dir: Path) -> None:
    reference = np.load(models_dir / "policy" / "artifacts" / "reference.npz")
    state = reference["input.state"]
    action, info = gr00t.get_action({"state": state}, {"priority": 0, "deadline_ms": 5000})
    np.testing.assert_allclose(action["action"], reference["output.action"], rtol=1e-5, atol=1e-6)
    assert info["model"] == "policy" and info["server_timing"]["infer_ms"] >= 0
    single, _ = gr00t.get_action({"state": state[0]})
    assert single["action"].shape == (8,)


def test_gr00t_errors_name_the_problem_and_the_server_keeps_serving(gr00t: Gr00tClient) -> None:
    with pytest.raises(RuntimeError, match="tensor 'video/ego_view' is not an input"):
        gr00t.get_action(
            {"state": np.zeros(32, np.float32), "video": {"ego_view": np.zeros((4, 4, 3), np.uint8)}}
        )
    with pytest.raises(RuntimeError, match="option 'temperature' is not supported"):
        gr00t.get_action({"state": np.zeros(32, np.float32)}, {"temperature": 0.5})
    with pytest.raises(RuntimeError, match="option 'priority' must be an integer"):
        gr00t.get_action({"state": np.zeros(32, np.float32)}, {"priority": "high"})
    with pytest.raises(RuntimeError, match="unknown endpoint 'teleport'"):
        gr00t.call("teleport", {})
    gr00t.socket.send(b"\xc1 not msgpack")
    assert b"not msgpack" in gr00t.socket.recv()
    action, _ = gr00t.get_action({"state": np.zeros(32, np.float32)})
    assert action["action"].shape == (8,)


def test_many_gr00t_clients_at_once(suite: Suite) -> None:
    clients = [Gr00tClient(suite.settings.gateway.gr00t.bind) for _ in range(6)]
    answers: list[np.ndarray] = []
    try:
        threads = [
            threading.Thread(
                target=lambda c=c, i=i: answers.append(
                    c.get_action({"state": np.full((1, 32), i, np.float32)})[0]["action"]
                )
            )
            for i, c in enumerate(clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
    finally:
        for client in clients:
            client.close()
    assert len(answers) == 6 and all(a.shape == (1, 8) for a in answers)


# ---- one scheduler behind every protocol ----------------------------------------------------


@needs_openpi
def test_priorities_hold_across_edge_gr00t_and_openpi(keyed_suite: Suite) -> None:
    """`sleep` runs 4 at a time: 16 low-priority edge and GR00T requests of 200 ms queue; a
    priority-0 request from openpi and one from GR00T, sent after them, go first."""
    suite = keyed_suite
    openpi = subprocess.Popen(
        [
            str(OPENPI_PYTHON),
            str(OPENPI_ROBOT),
            _url(suite, "sleep", "?priority=0"),
            "wait-then-sleep",
            "200",
            ROBOT_KEY,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert openpi.stdout is not None and openpi.stdin is not None
        assert openpi.stdout.readline().strip() == "ready"
        finished: dict[str, Any] = {}
        started = time.monotonic()
        edge = _flood_edge(suite.settings.gateway.edge.bind, 10, finished, started)
        low_gr00t = [_gr00t_sleep(suite, f"low-{n}", 9, finished, started) for n in range(6)]
        time.sleep(0.15)
        high_gr00t = _gr00t_sleep(suite, "high-gr00t", 0, finished, started)
        openpi.stdin.write("go\n")
        openpi.stdin.flush()
        reply = json.loads(openpi.stdout.readline())
        finished["high-openpi"] = time.monotonic() - started
        for thread in [edge, *low_gr00t, high_gr00t]:
            thread.join(TIMEOUT_S)
    finally:
        openpi.kill()
        openpi.wait()
    assert reply["ms"] == 200.0
    failed = {name: t for name, t in finished.items() if isinstance(t, str)}
    assert not failed, failed
    low = sorted(t for name, t in finished.items() if name.startswith(("low", "edge")))
    assert len(low) == 16, finished
    assert min(low) >= 0.15, finished  # each slept its 200 ms (no quick error replies)
    for name in ("high-openpi", "high-gr00t"):
        overtaken = sum(t > finished[name] for t in low)
        assert overtaken >= 4, (name, finished)  # it went ahead of queued low-priority ones


def test_keys_are_checked_for_openpi_and_gr00t(keyed_suite: Suite) -> None:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    url = _url(keyed_suite, "sleep")
    with pytest.raises(InvalidStatus) as missing:
        connect(url, open_timeout=10)
    assert missing.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as wrong:
        connect(url, open_timeout=10, additional_headers={"Authorization": "Api-Key lm_not-a-key"})
    assert wrong.value.response.status_code == 401
    with connect(url, open_timeout=10, additional_headers={"Authorization": f"Api-Key {ROBOT_KEY}"}) as ok:
        assert ok.recv(timeout=10)  # the metadata frame
    bind = keyed_suite.settings.gateway.gr00t.bind
    for token in (None, "lm_not-a-key"):
        client = Gr00tClient(bind, api_token=token)
        try:
            with pytest.raises(RuntimeError, match="unauthenticated"):
                client.ping()
        finally:
            client.close()
    client = Gr00tClient(bind, api_token=ROBOT_KEY)
    try:
        assert client.ping()["status"] == "ok"
        action, _ = client.get_action({"ms": np.array([1.0], np.float32)})
        assert action["ms"].tolist() == [1.0]
    finally:
        client.close()


def _flood_edge(edge: str, count: int, finished: dict[str, Any], started: float) -> threading.Thread:
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(edge)
    for n in range(count):
        envelope, payload = _observation(
            "sleep", {"ms": np.array([200.0], np.float32)}, priority=9, client="flood"
        )
        envelope.metadata["request_id"] = f"edge-{n}"
        socket.send_multipart([b"", envelope.SerializeToString(), payload])

    def collect() -> None:
        try:
            for _ in range(count):
                if not socket.poll(TIMEOUT_S * 1000):
                    return
                _, envelope, *_ = socket.recv_multipart()
                response = edge_pb2.ModelResponse.FromString(envelope)
                error = response.metadata.get("error")
                finished[response.response_id] = error if error else time.monotonic() - started
        finally:
            socket.close()

    thread = threading.Thread(target=collect)
    thread.start()
    return thread


def _gr00t_sleep(
    suite: Suite, name: str, priority: int, finished: dict[str, Any], started: float
) -> threading.Thread:
    client = Gr00tClient(suite.settings.gateway.gr00t.bind)
    observation = {"ms": np.array(200.0, np.float32)}  # (GR00T packs ndarrays only)
    data = {"observation": observation, "options": {"priority": priority}}
    client.socket.send(pack({"endpoint": "get_action", "data": data, "api_token": ROBOT_KEY}))

    def wait() -> None:
        try:
            reply = unpack(client.socket.recv())
            finished[name] = reply["error"] if "error" in reply else time.monotonic() - started
        finally:
            client.close()

    thread = threading.Thread(target=wait)
    thread.start()
    return thread


# ---- JPEG and PNG camera frames -------------------------------------------------------------


def _frame(height: int = 480, width: int = 640) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 / width, y * 255 / height, (x + y) * 255 / (width + height)], -1).astype(
        np.uint8
    )


def _observation(
    model: str,
    arrays: dict[str, np.ndarray],
    *,
    images: dict[str, tuple[bytes, tuple[int, ...], int]] | None = None,
    priority: int = 1,
    client: str = "camera",
) -> tuple[edge_pb2.Observation, bytes]:
    """An Inferential-protocol observation; `images`: key -> (compressed bytes, decoded shape, encoding)."""
    observation = edge_pb2.Observation(model_id=model, priority=priority)
    observation.client.id = client
    parts: list[bytes] = []
    offset = 0
    for key, array in arrays.items():
        data = array.tobytes()
        dtype = {np.dtype(np.float32): tensor_pb2.DTYPE_FLOAT32, np.dtype(np.uint8): tensor_pb2.DTYPE_UINT8}
        observation.tensors.add(
            key=key,
            dtype=dtype[array.dtype],
            shape=array.shape,
            byte_offset=offset,
            byte_length=len(data),
            encoding=tensor_pb2.ENCODING_RAW,
        )
        parts.append(data)
        offset += len(data)
    for key, (data, shape, encoding) in (images or {}).items():
        observation.tensors.add(
            key=key,
            dtype=tensor_pb2.DTYPE_UINT8,
            shape=shape,
            byte_offset=offset,
            byte_length=len(data),
            encoding=encoding,
        )
        parts.append(data)
        offset += len(data)
    return observation, b"".join(parts)


@pytest.fixture()
def edge_call(edge_address: str) -> Iterator[Callable[..., tuple[edge_pb2.ModelResponse, bytes]]]:
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(edge_address)

    def call(observation: edge_pb2.Observation, payload: bytes) -> tuple[edge_pb2.ModelResponse, bytes]:
        socket.send_multipart([b"", observation.SerializeToString(), payload])
        assert socket.poll(TIMEOUT_S * 1000), "no reply"
        frames = socket.recv_multipart()
        return edge_pb2.ModelResponse.FromString(frames[1]), frames[2] if len(frames) > 2 else b""

    yield call
    socket.close()


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def test_jpeg_and_png_frames_reach_the_model_decoded(edge_call: Callable[..., Any]) -> None:
    pixels = _frame()
    jpeg = simplejpeg.encode_jpeg(pixels, quality=90)
    assert len(jpeg) * 10 < pixels.nbytes
    images = {
        "camera": (jpeg, pixels.shape, tensor_pb2.ENCODING_JPEG),
        "wrist": (_png(pixels[:120, :160]), (120, 160, 3), tensor_pb2.ENCODING_PNG),
    }
    response, payload = edge_call(*_observation("echo", {"state": np.ones(4, np.float32)}, images=images))
    assert "error" not in response.metadata, dict(response.metadata)
    outputs = {t.key: t for t in response.tensors}
    camera = outputs["camera"]
    assert camera.dtype == tensor_pb2.DTYPE_UINT8 and list(camera.shape) == [480, 640, 3]
    assert camera.encoding != tensor_pb2.ENCODING_JPEG  # the model's output is raw pixels
    decoded = np.frombuffer(payload, np.uint8, camera.byte_length, camera.byte_offset).reshape(480, 640, 3)
    assert np.abs(decoded.astype(int) - pixels).mean() < 2.0
    wrist = outputs["wrist"]
    exact = np.frombuffer(payload, np.uint8, wrist.byte_length, wrist.byte_offset).reshape(120, 160, 3)
    np.testing.assert_array_equal(exact, pixels[:120, :160])


def test_corrupt_and_oversized_jpegs_are_refused_naming_the_tensor(edge_call: Callable[..., Any]) -> None:
    pixels = _frame()
    jpeg = simplejpeg.encode_jpeg(pixels, quality=90)
    cases = [
        # a cut-off stream: the worker's decoder fails on it
        ((jpeg[: len(jpeg) // 2], (480, 640, 3), tensor_pb2.ENCODING_JPEG), "corrupt JPEG"),
        # garbage with a JPEG's first bytes
        ((b"\xff\xd8\xff" + bytes(500), (480, 640, 3), tensor_pb2.ENCODING_JPEG), "JPEG"),
        # a frame larger than it claims: the worker checks the header before decoding
        ((jpeg, (240, 320, 3), tensor_pb2.ENCODING_JPEG), "the JPEG image is [480, 640, 3]"),
        # a claim past the pixel limit: refused by the gateway, never decoded
        ((jpeg, (10000, 10000, 3), tensor_pb2.ENCODING_JPEG), "exceed the limit"),
        # not UINT8 [H, W, C]
        ((jpeg, (480, 640), tensor_pb2.ENCODING_JPEG), "[height, width, channels]"),
    ]
    for image, expected in cases:
        response, _ = edge_call(*_observation("echo", {}, images={"camera": image}))
        assert response.metadata.get("error_code") == "invalid_argument", dict(response.metadata)
        assert "tensor 'camera'" in response.metadata["error"] and expected in response.metadata["error"]
    response, _ = edge_call(
        *_observation("echo", {}, images={"camera": (jpeg, (480, 640, 3), tensor_pb2.ENCODING_JPEG)})
    )
    assert "error" not in response.metadata  # the suite keeps serving


def test_kserve_bytes_input_declared_as_an_image_takes_a_jpeg(suite: Suite, models_dir: Path) -> None:
    reference = np.load(models_dir / "classifier" / "artifacts" / "reference.npz")
    pixels = reference["input.image"]
    png = _png(pixels)  # lossless: the logits must match the reference
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(png) + 4},
                }
            ],
            "outputs": [{"name": "logits", "parameters": {"binary_data": False}}],
        }
    ).encode()
    body = header + len(png).to_bytes(4, "little") + png
    gateway = suite.settings.gateway
    reply = httpx.post(
        f"http://{gateway.http_host}:{gateway.http_port}/v2/models/classifier/infer",
        content=body,
        headers={
            "Inference-Header-Content-Length": str(len(header)),
            "Content-Type": "application/octet-stream",
        },
        timeout=TIMEOUT_S,
    )
    assert reply.status_code == 200, reply.text
    logits = np.array(reply.json()["outputs"][0]["data"], np.float32)
    np.testing.assert_allclose(logits, reference["output.logits"], rtol=1e-4, atol=1e-4)
