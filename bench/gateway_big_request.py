"""One maximum-size request against a well-behaved client's latency (issue 25, "no request can stall another").

    python bench/gateway_big_request.py                 # starts the suite on free ports
    python bench/gateway_big_request.py --label before  # names the result file (default: after)

A well-behaved client (stock tritonclient[http], one `double` request every 5 ms: 200 req/s)
runs through every scenario. In each, after a quiet second, another process sends one
maximum-size request to the gateway; the well-behaved client's latencies over the scenario's
window give its worst and p99, and the gateway's resident memory is sampled every 20 ms:

  bytes-16M-empty  64 MiB BYTES tensor of 16,777,216 empty elements (binary), on HTTP, gRPC, edge
  bytes-1M-60B     64 MiB BYTES tensor of 1,048,576 elements of 60 bytes (binary), on HTTP, gRPC, edge
  json-64MB        a ~64 MB JSON body (FP32 values) on HTTP
  json-at-limit    a JSON body just under the JSON limit (4 MiB by default) on HTTP

The big requests name a model no worker serves (`bench-no-such-model`), so what is measured is
the gateway: reading, parsing and checking the request, then answering it. Writes
bench/results/gateway_big_request_<label>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from _harness import running_suite_handle, write_result

BIG_MODEL = "bench-no-such-model"
PERIOD_S = 0.005  # 200 req/s
MAX_PAYLOAD = 64 << 20


# --- the sender (a separate process, so its own work does not slow the measuring client) -------


def _bytes_payload(kind: str) -> tuple[int, bytes]:
    if kind == "bytes-16M-empty":
        return MAX_PAYLOAD // 4, bytes(MAX_PAYLOAD)
    count = 1 << 20
    element = (60).to_bytes(4, "little") + b"x" * 60
    return count, element * count


def _send_http(address: str, kind: str) -> str:
    import httpx

    url = f"http://{address}/v2/models/{BIG_MODEL}/infer"
    if kind.startswith("json"):
        size = 64_000_000 if kind == "json-64MB" else (4 << 20) - 1024  # "0.123456789, " is 13 bytes
        count = size // 13
        body = json.dumps(
            {"inputs": [{"name": "x", "shape": [count], "datatype": "FP32", "data": [0.123456789] * count}]}
        ).encode()
        reply = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=120)
        return f"{reply.status_code} ({len(body) / 1e6:.1f} MB JSON): {reply.text[:120]}"
    count, data = _bytes_payload(kind)
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [count],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(data)},
                }
            ]
        }
    ).encode()
    reply = httpx.post(
        url, content=head + data, headers={"Inference-Header-Content-Length": str(len(head))}, timeout=120
    )
    return f"{reply.status_code}: {reply.text[:120]}"


def _send_grpc(address: str, kind: str) -> str:
    import grpc
    from tritonclient.grpc import service_pb2 as inference_pb2

    count, data = _bytes_payload(kind)
    request = inference_pb2.ModelInferRequest(model_name=BIG_MODEL)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "x", "BYTES"
    tensor.shape.append(count)
    request.raw_input_contents.append(data)
    message = request.SerializeToString()
    options = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
    with grpc.insecure_channel(address, options=options) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        try:
            call(message, timeout=120)
            return "OK"
        except grpc.RpcError as error:
            return f"{error.code()}: {(error.details() or '')[:120]}"


def _send_edge(address: str, kind: str) -> str:
    import zmq

    from loadmaster.v1 import edge_pb2, tensor_pb2

    count, data = _bytes_payload(kind)
    observation = edge_pb2.Observation(
        model_id=BIG_MODEL,
        tensors=[
            tensor_pb2.Tensor(
                key="x", dtype=tensor_pb2.DTYPE_BYTES, shape=[count], byte_length=len(data), encoding=tensor_pb2.ENCODING_RAW
            )
        ],
    )
    observation.client.id = "bench-big"
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        dealer.send_multipart([b"", observation.SerializeToString(), data])
        if not dealer.poll(120_000):
            return "no reply in 120 s"
        frames = dealer.recv_multipart()
        dealer.close()
    finally:
        context.term()
    response = edge_pb2.ModelResponse.FromString(frames[1])
    return f"{response.metadata.get('error_code', 'ok')}: {response.metadata.get('error', '')[:120]}"


def send(front_end: str, address: str, kind: str) -> None:
    started = time.perf_counter()
    outcome = {"http": _send_http, "grpc": _send_grpc, "edge": _send_edge}[front_end](address, kind)
    print(json.dumps({"outcome": outcome, "seconds": round(time.perf_counter() - started, 3)}))


# --- the measuring side ------------------------------------------------------------------------


@dataclass
class Background:
    """The well-behaved client: `double` every PERIOD_S, each latency with its start time."""

    address: str
    samples: list[tuple[float, float]] = field(default_factory=list)
    errors: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="well-behaved", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        import tritonclient.http as triton_http

        client = triton_http.InferenceServerClient(self.address, network_timeout=60)
        x = np.arange(7, dtype=np.float32)
        tensor = triton_http.InferInput("x", [7], "FP32")
        tensor.set_data_from_numpy(x)
        next_at = time.perf_counter()
        try:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    out = client.infer("double", [tensor]).as_numpy("x")
                    if out is None or out[1] != 2.0:
                        self.errors += 1
                except Exception:
                    self.errors += 1
                self.samples.append((start, time.perf_counter() - start))
                next_at += PERIOD_S
                delay = next_at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                else:
                    next_at = time.perf_counter()  # late: no burst to catch up
        finally:
            client.close()


class RssSampler:
    def __init__(self, pid: int) -> None:
        import psutil

        self._process = psutil.Process(pid)
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.samples.append(self._process.memory_info().rss)


def scenario(
    background: Background, gateway_pid: int, front_end: str, address: str, kind: str, *, settle_s: float
) -> dict[str, Any]:
    import psutil

    idle_rss = psutil.Process(gateway_pid).memory_info().rss
    time.sleep(1.0)
    begin = time.perf_counter()
    sent: dict[str, Any] = {"outcome": "", "seconds": None}
    with RssSampler(gateway_pid) as rss:
        if front_end == "none":  # the baseline: the same window with nothing big sent
            time.sleep(2.0)
        else:
            sender = subprocess.run(
                [sys.executable, __file__, "--send", front_end, address, kind],
                capture_output=True,
                text=True,
                timeout=300,
            )
            try:
                sent = json.loads(sender.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                sent = {"outcome": f"sender failed: {sender.stderr[-400:]}", "seconds": None}
        time.sleep(settle_s)
    end = time.perf_counter()
    latencies = [latency for started, latency in background.samples if begin <= started <= end]
    values = np.asarray(latencies) * 1000
    return {
        "front_end": front_end,
        "request": kind,
        "big_request_outcome": sent["outcome"],
        "big_request_s": sent["seconds"],
        "well_behaved": {
            "requests": len(values),
            "p50_ms": round(float(np.percentile(values, 50)), 2),
            "p99_ms": round(float(np.percentile(values, 99)), 2),
            "worst_ms": round(float(values.max()), 2),
        },
        "gateway_rss_mb": {
            "idle": round(idle_rss / 2**20, 1),
            "peak_growth": round((max(rss.samples, default=idle_rss) - idle_rss) / 2**20, 1),
            "growth_after": round((rss.samples[-1] - idle_rss) / 2**20, 1) if rss.samples else None,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--send", nargs=3, metavar=("FRONT_END", "ADDRESS", "KIND"), help=argparse.SUPPRESS)
    parser.add_argument("--label", default="after")
    parser.add_argument("--settle-s", type=float, default=1.5, help="measured time after the big reply")
    parser.add_argument("--only", default="", help="comma-separated scenario names (front_end:kind)")
    args = parser.parse_args()
    if args.send:
        send(*args.send)
        return 0
    plan = [
        ("none", "baseline"),
        ("http", "bytes-16M-empty"),
        ("grpc", "bytes-16M-empty"),
        ("edge", "bytes-16M-empty"),
        ("http", "bytes-1M-60B"),
        ("grpc", "bytes-1M-60B"),
        ("edge", "bytes-1M-60B"),
        ("http", "json-64MB"),
        ("http", "json-at-limit"),
    ]
    if args.only:
        wanted = set(args.only.split(","))
        plan = [step for step in plan if f"{step[0]}:{step[1]}" in wanted or step[0] == "none"]
    results: list[dict[str, Any]] = []
    with running_suite_handle(preload=["double"]) as suite:
        gateway = suite.settings.gateway
        service = suite.service("gateway")
        assert service is not None
        pid = service.process.pid
        http = f"{gateway.http_host}:{gateway.http_port}"
        addresses = {"http": http, "grpc": gateway.address, "edge": gateway.edge.bind, "none": ""}
        background = Background(http)
        background.start()
        time.sleep(2.0)  # warm up
        try:
            for front_end, kind in plan:
                step = scenario(
                    background, pid, front_end, addresses[front_end], kind, settle_s=args.settle_s
                )
                results.append(step)
                print(
                    f"{front_end:>5} {kind:<16} worst {step['well_behaved']['worst_ms']:>8} ms  "
                    f"p99 {step['well_behaved']['p99_ms']:>7} ms  big {step['big_request_s']} s  "
                    f"rss +{step['gateway_rss_mb']['peak_growth']} MB peak, "
                    f"+{step['gateway_rss_mb']['growth_after']} MB after  [{step['big_request_outcome'][:60]}]",
                    flush=True,
                )
        finally:
            background.stop()
    path = write_result(
        f"gateway_big_request_{args.label}",
        {
            "well_behaved_client": "tritonclient[http], double, 7 x FP32, one request per 5 ms",
            "big_requests_to": BIG_MODEL,
            "background_errors": background.errors,
            "scenarios": results,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
