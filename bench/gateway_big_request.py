"""Maximum-size requests on each front end against small requests on the others (issue 35 item 4:
"front ends cannot stall each other"; first written for issue 25, "no request can stall another").

    python bench/gateway_big_request.py                   # both gRPC arrangements, ~10 minutes
    python bench/gateway_big_request.py --arrangements process --repeat 5
    python bench/gateway_big_request.py --only grpc:bytes-16M-empty --label grpc-only

Three well-behaved clients, each its own process, send `double` (7 x FP32) through the three
front ends all the time, one request per 20 ms each: stock tritonclient[http] (HTTP), stock
tritonclient[grpc] (gRPC) and a ZMQ DEALER speaking the edge protocol (edge). Each latency is
counted from the request's *scheduled* time, so a stall shows in every request it delays
(a client that waits for its reply would otherwise send one late request and count one sample).
In each scenario another process sends one maximum-size request `--repeat` times to one front
end; each time, the window runs from the send to `--settle-s` after the reply. A client's p99 in
a scenario is the median of its p99 in each window (the machine is shared: a burst of other work
hits one window, a stall the big request causes hits every one), compared with the same in
windows with nothing big sent (`baseline`); its worst is the worst of all windows:

  bytes-16M-empty   64 MiB BYTES tensor of 16,777,216 empty elements (binary), on HTTP, gRPC, edge
  bytes-1M-60B      64 MiB BYTES tensor of 1,048,576 elements of 60 bytes (binary), on HTTP, gRPC, edge
  json-64MB         a ~64 MB JSON body (FP32 values) on KServe HTTP (refused by its length)
  json-at-limit     a KServe JSON body just under the JSON limit (4 MiB by default) on HTTP
  openai-at-limit   an OpenAI chat body just under its 4 MiB limit, one long message, on HTTP
  openai-many       an OpenAI chat body just under 4 MiB of 100,000 short messages, on HTTP
  fp32-64MiB-echo   16 Mi FP32 (64 MiB) through `echo` and back (binary), on HTTP, gRPC, edge:
                    the whole path, dispatch, worker and a 64 MiB reply included (the worker is
                    the small clients' too, so its share of their wait is not the front end's)

The gateway's own event-loop lag in each window (`event_loop_lag_ms`, which it reports to the
metrics service each second) is shown beside them: on a busy 2-core machine the clients' numbers
also carry CPU contention from the big request's sender and copies, the loop lag does not.

The target: a big request on one front end costs a small request on *another* front end
<= 100 ms more at p99 (`extra_p99_ms`); each such pair prints met/missed. The same front end's
own clients are shown too, but they are not the target (they share its process and socket).
The big requests but `fp32-64MiB-echo` name a model no worker serves (`bench-no-such-model`),
so what is measured is the gateway reading, parsing and checking a request, then answering it.

`--arrangements` runs the plan with the gRPC front end in its own process (`process`, the
default since issue 35) and/or on the gateway's event loop (`loop`, `gateway.grpc_process:
false`), each on a freshly started suite, in the same run. Writes
bench/results/gateway_big_request_<label>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _harness import running_suite_handle, write_result

BIG_MODEL = "bench-no-such-model"
ECHO_MODEL = "echo"
SMALL_MODEL = "double"
PERIOD_S = 0.020  # each small client: 50 requests/s
MAX_PAYLOAD = 64 << 20
FRONT_ENDS = ("http", "grpc", "edge")
TARGET_EXTRA_MS = 100.0
PLAN = [
    ("http", "bytes-16M-empty"),
    ("grpc", "bytes-16M-empty"),
    ("edge", "bytes-16M-empty"),
    ("http", "bytes-1M-60B"),
    ("grpc", "bytes-1M-60B"),
    ("edge", "bytes-1M-60B"),
    ("http", "json-64MB"),
    ("http", "json-at-limit"),
    ("http", "openai-at-limit"),
    ("http", "openai-many"),
    ("http", "fp32-64MiB-echo"),
    ("grpc", "fp32-64MiB-echo"),
    ("edge", "fp32-64MiB-echo"),
]


# --- the big request (a process of its own, so its work does not slow the measuring side) ----


def _tensor(kind: str) -> tuple[str, str, int, bytes]:
    """(model, datatype, element count, data) of a binary big request."""
    if kind == "fp32-64MiB-echo":  # a real round trip: 64 MiB in, the same 64 MiB back
        return ECHO_MODEL, "FP32", MAX_PAYLOAD // 4, bytes(MAX_PAYLOAD)
    count, data = _bytes_payload(kind)
    return BIG_MODEL, "BYTES", count, data


def _bytes_payload(kind: str) -> tuple[int, bytes]:
    if kind == "bytes-16M-empty":
        return MAX_PAYLOAD // 4, bytes(MAX_PAYLOAD)
    count = 1 << 20
    element = (60).to_bytes(4, "little") + b"x" * 60
    return count, element * count


def _openai_body(kind: str) -> bytes:
    limit = (4 << 20) - 4096
    if kind == "openai-at-limit":
        messages = [{"role": "user", "content": "x" * (limit - 200)}]
    else:
        one = len(json.dumps({"role": "user", "content": "hi"})) + 2
        messages = [{"role": "user", "content": "hi"}] * min(100_000, limit // one - 10)
    return json.dumps({"model": BIG_MODEL, "messages": messages}).encode()


def _http_sender(address: str, kind: str) -> Callable[[], str]:
    import httpx

    client = httpx.Client(timeout=120)
    if kind.startswith("openai"):
        url = f"http://{address}/v1/chat/completions"
        body = _openai_body(kind)
        headers = {"Content-Type": "application/json"}
    elif kind.startswith("json"):
        url = f"http://{address}/v2/models/{BIG_MODEL}/infer"
        size = 64_000_000 if kind == "json-64MB" else (4 << 20) - 1024  # "0.123456789, " is 13 bytes
        count = size // 13
        body = json.dumps(
            {"inputs": [{"name": "x", "shape": [count], "datatype": "FP32", "data": [0.123456789] * count}]}
        ).encode()
        headers = {"Content-Type": "application/json"}
    else:
        model, datatype, count, data = _tensor(kind)
        url = f"http://{address}/v2/models/{model}/infer"
        head = json.dumps(
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": [count],
                        "datatype": datatype,
                        "parameters": {"binary_data_size": len(data)},
                    }
                ],
                "outputs": [{"name": "x", "parameters": {"binary_data": True}}],
            }
        ).encode()
        body = head + data
        headers = {"Inference-Header-Content-Length": str(len(head))}

    def send() -> str:
        reply = client.post(url, content=body, headers=headers)
        if reply.status_code == 200:
            return f"200 ({len(body) / 1e6:.1f} MB, {len(reply.content) / 1e6:.1f} MB back)"
        return f"{reply.status_code} ({len(body) / 1e6:.1f} MB): {reply.text[:100]}"

    return send


def _grpc_sender(address: str, kind: str) -> Callable[[], str]:
    import grpc
    from tritonclient.grpc import service_pb2 as inference_pb2

    model, datatype, count, data = _tensor(kind)
    request = inference_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "x", datatype
    tensor.shape.append(count)
    request.raw_input_contents.append(data)
    message = request.SerializeToString()
    options = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
    channel = grpc.insecure_channel(address, options=options)
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

    def send() -> str:
        try:
            reply = call(message, timeout=120)
            return f"OK ({len(reply) / 1e6:.1f} MB back)"
        except grpc.RpcError as error:
            return f"{error.code()}: {(error.details() or '')[:100]}"

    return send


def _edge_observation(model: str, key: str, dtype: Any, shape: list[int], length: int) -> bytes:
    from loadmaster.v1 import edge_pb2, tensor_pb2

    observation = edge_pb2.Observation(
        model_id=model,
        tensors=[
            tensor_pb2.Tensor(
                key=key, dtype=dtype, shape=shape, byte_length=length, encoding=tensor_pb2.ENCODING_RAW
            )
        ],
    )
    observation.client.id = f"bench-{model}"
    return observation.SerializeToString()


def _edge_sender(address: str, kind: str) -> Callable[[], str]:
    import zmq

    from loadmaster.v1 import edge_pb2, tensor_pb2

    model, datatype, count, data = _tensor(kind)
    dtype = tensor_pb2.DTYPE_FLOAT32 if datatype == "FP32" else tensor_pb2.DTYPE_BYTES
    envelope = _edge_observation(model, "x", dtype, [count], len(data))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)

    def send() -> str:
        dealer.send_multipart([b"", envelope, data], copy=False)
        if not dealer.poll(120_000):
            return "no reply in 120 s"
        frames = dealer.recv_multipart()
        response = edge_pb2.ModelResponse.FromString(frames[1])
        back = f" ({len(frames[2]) / 1e6:.1f} MB back)" if len(frames) > 2 else ""
        return (
            f"{response.metadata.get('error_code', 'ok')}{back}: {response.metadata.get('error', '')[:100]}"
        )

    return send


def sender(front_end: str, address: str, kind: str) -> None:
    """Prepare the request (outside the measured window), say `ready`, then send it once per
    line read from stdin, printing each outcome."""
    send = {"http": _http_sender, "grpc": _grpc_sender, "edge": _edge_sender}[front_end](address, kind)
    print("ready", flush=True)
    for _ in sys.stdin:
        started = time.perf_counter()
        outcome = send()
        print(
            json.dumps({"outcome": outcome, "seconds": round(time.perf_counter() - started, 3)}), flush=True
        )


# --- the small requests (one process per front end, until its stdin closes) -------------------


def _small_call(front_end: str, address: str) -> tuple[Any, Any]:
    """(call, close): `call()` sends one `double` request and says whether its answer is right."""
    x = np.arange(7, dtype=np.float32)
    if front_end in ("http", "grpc"):
        import importlib

        triton = importlib.import_module(f"tritonclient.{front_end}")
        client = triton.InferenceServerClient(address)
        tensor = triton.InferInput("x", [7], "FP32")
        tensor.set_data_from_numpy(x)

        def kserve() -> bool:
            out = client.infer(SMALL_MODEL, [tensor]).as_numpy("x")
            return out is not None and bool(out[1] == 2.0)

        return kserve, client.close
    import zmq

    from loadmaster.v1 import edge_pb2, tensor_pb2

    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    envelope = _edge_observation(SMALL_MODEL, "x", tensor_pb2.DTYPE_FLOAT32, [7], x.nbytes)
    payload = x.tobytes()

    def edge() -> bool:
        dealer.send_multipart([b"", envelope, payload])
        if not dealer.poll(30_000):
            raise TimeoutError("no edge reply in 30 s")
        frames = dealer.recv_multipart()
        response = edge_pb2.ModelResponse.FromString(frames[1])
        return not response.metadata.get("error_code") and bool(
            np.frombuffer(frames[2], np.float32)[1] == 2.0
        )

    def close() -> None:
        dealer.close()
        context.term()

    return edge, close


def small(front_end: str, address: str) -> None:
    """Send on a fixed schedule until stdin closes; print [[scheduled, latency, ok], ...]."""
    import threading

    call, close = _small_call(front_end, address)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    samples: list[tuple[float, float, bool]] = []
    scheduled = time.monotonic()
    try:
        while not stop.is_set():
            delay = scheduled - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                ok = call()
            except Exception:
                ok = False
            samples.append((scheduled, time.monotonic() - scheduled, ok))
            scheduled += PERIOD_S
    finally:
        close()
    print(json.dumps(samples))


class SmallClients:
    """The three well-behaved clients, each a process of its own."""

    def __init__(self, addresses: dict[str, str]) -> None:
        self._processes = {
            front_end: subprocess.Popen(
                [sys.executable, __file__, "--small", front_end, addresses[front_end]],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for front_end in FRONT_ENDS
        }
        self.samples: dict[str, np.ndarray] = {}

    def stop(self) -> None:
        for front_end, process in self._processes.items():
            try:
                out, _ = process.communicate(timeout=60)
                rows = json.loads(out.strip().splitlines()[-1])
            except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError):
                process.kill()
                rows = []
            self.samples[front_end] = np.asarray(rows, dtype=float).reshape(-1, 3)


def window_stats(samples: np.ndarray, windows: list[tuple[float, float]]) -> dict[str, Any]:
    """One client's requests in each window: the median over the windows of each window's p50
    and p99 (a burst of other work on a shared machine hits one window, a stall that the big
    request causes hits each), and the worst of all."""
    per_window = []
    worst, count, failed = 0.0, 0, 0
    for begin, end in windows:
        rows = samples[(samples[:, 0] >= begin) & (samples[:, 0] <= end)]
        if not len(rows):
            continue
        latencies = rows[:, 1] * 1000
        per_window.append((float(np.percentile(latencies, 50)), float(np.percentile(latencies, 99))))
        worst = max(worst, float(latencies.max()))
        count += len(rows)
        failed += int((rows[:, 2] == 0).sum())
    if not per_window:
        return {"requests": 0}
    return {
        "requests": count,
        "failed": failed,
        "p50_ms": round(float(np.median([p50 for p50, _ in per_window])), 2),
        "p99_ms": round(float(np.median([p99 for _, p99 in per_window])), 2),
        "p99_per_window_ms": [round(p99, 2) for _, p99 in per_window],
        "worst_ms": round(worst, 2),
    }


# --- the measuring side ------------------------------------------------------------------------


def loop_lag_ms(metrics_address: str, since: float) -> float | None:
    """The gateway's longest event-loop delay since `since` (monotonic), as it reported it
    (`event_loop_lag_ms`, one reading per second): its own loop, without the clients' noise."""
    import grpc

    from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc

    time.sleep(1.5)  # the reading of the window's last second, then its flush
    request = metrics_pb2.GetStatsRequest(
        name="event_loop_lag_ms", labels={"service": "gateway"}, window_s=time.monotonic() - since
    )
    try:
        with grpc.insecure_channel(metrics_address) as channel:
            stats = metrics_pb2_grpc.MetricsServiceStub(channel).GetStats(request, timeout=5).stats
    except grpc.RpcError:
        return None
    return round(stats.max, 1) if stats.count else None


class BigRequests:
    """A process that sends one front end the same big request whenever asked."""

    def __init__(self, front_end: str, address: str, kind: str) -> None:
        self._process = subprocess.Popen(
            [sys.executable, __file__, "--send", front_end, address, kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        if self._process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {front_end} sender of {kind} did not start")

    def send(self) -> dict[str, Any]:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write("go\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        try:
            return dict(json.loads(line))
        except json.JSONDecodeError:
            return {"outcome": f"sender failed: {line[:200]!r}", "seconds": None}

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            self._process.kill()


def run_arrangement(
    arrangement: str, plan: list[tuple[str, str]], args: argparse.Namespace
) -> dict[str, Any]:
    overrides: dict[str, Any] = {
        "gateway": {"grpc_process": arrangement == "process"},
        # the gateway's loop probe at 10 ms (the default 100 ms reads short stalls low)
        "metrics": {"loop_lag_tick_ms": 10.0},
    }
    windows: list[dict[str, Any]] = []
    with running_suite_handle(preload=[SMALL_MODEL, ECHO_MODEL], overrides=overrides) as suite:
        gateway = suite.settings.gateway
        addresses = {
            "http": f"{gateway.http_host}:{gateway.http_port}",
            "grpc": gateway.address,
            "edge": gateway.edge.bind,
        }
        clients = SmallClients(addresses)
        try:
            time.sleep(3.0)  # warm up
            metrics = suite.settings.metrics.address
            quiet: list[tuple[float, float]] = []
            lags: list[float | None] = []
            for _ in range(args.repeat):
                begin = time.monotonic()
                time.sleep(1.0 + args.settle_s)
                quiet.append((begin, time.monotonic()))
                lags.append(loop_lag_ms(metrics, begin))
            windows.append({"front_end": "none", "request": "baseline", "windows": quiet, "lags": lags})
            for front_end, kind in plan:
                big = BigRequests(front_end, addresses[front_end], kind)  # prepared outside the windows
                spans: list[tuple[float, float]] = []
                lags = []
                sent = []
                try:
                    time.sleep(1.0)
                    for _ in range(args.repeat):
                        begin = time.monotonic()
                        sent.append(big.send())
                        time.sleep(args.settle_s)
                        spans.append((begin, time.monotonic()))
                        lags.append(loop_lag_ms(metrics, begin))
                finally:
                    big.close()
                windows.append(
                    {"front_end": front_end, "request": kind, "windows": spans, "lags": lags, "sent": sent}
                )
                print(f"  [{arrangement}] {front_end} {kind}: {sent[-1]['outcome'][:70]}", flush=True)
        finally:
            clients.stop()
    scenarios: list[dict[str, Any]] = []
    baseline: dict[str, dict[str, Any]] = {}
    for entry in windows:
        spans = entry.pop("windows")
        small_stats = {name: window_stats(clients.samples[name], spans) for name in FRONT_ENDS}
        lags = [lag for lag in entry.pop("lags") if lag is not None]
        entry["gateway_loop_lag_ms"] = {
            "median": round(float(np.median(lags)), 1) if lags else None,
            "max": max(lags) if lags else None,
        }
        if entry["front_end"] == "none":
            baseline = small_stats
        for name, stats in small_stats.items():
            if stats["requests"] and baseline.get(name, {}).get("requests"):
                stats["extra_p99_ms"] = round(stats["p99_ms"] - baseline[name]["p99_ms"], 2)
                if entry["front_end"] not in ("none", name):
                    stats["target"] = "met" if stats["extra_p99_ms"] <= TARGET_EXTRA_MS else "missed"
        scenarios.append(
            {**entry, "windows_s": [round(end - begin, 2) for begin, end in spans], "small": small_stats}
        )
    return {"arrangement": arrangement, "scenarios": scenarios}


def report(result: dict[str, Any]) -> list[str]:
    lines = [f"gRPC front end: {result['arrangement']}"]
    header = f"  {'big request on':<26}" + "".join(f"{'small ' + name:>30}" for name in FRONT_ENDS)
    header += f"{'loop lag':>14}"
    units = "".join(f"{'p99 (+extra) / worst ms':>30}" for _ in FRONT_ENDS) + f"{'med / max ms':>14}"
    lines += [header, "  " + " " * 26 + units]
    for scenario in result["scenarios"]:
        cells = []
        for name in FRONT_ENDS:
            stats = scenario["small"][name]
            if not stats.get("requests"):
                cells.append(f"{'-':>30}")
                continue
            extra = f" (+{stats['extra_p99_ms']:.0f})" if "extra_p99_ms" in stats else ""
            mark = {"met": " ok", "missed": " MISS"}.get(stats.get("target", ""), "")
            cells.append(f"{stats['p99_ms']:.0f}{extra} / {stats['worst_ms']:.0f}{mark}".rjust(30))
        lag = scenario.get("gateway_loop_lag_ms") or {}
        shown = "-" if lag.get("median") is None else f"{lag['median']:.0f} / {lag['max']:.0f}"
        lines.append(
            f"  {scenario['front_end'] + ' ' + scenario['request']:<26}" + "".join(cells) + f"{shown:>14}"
        )
    for pair in pair_verdicts(result):
        lines.append(
            f"  {pair['size']:>6} on {pair['big']:<4} -> small on {pair['small']:<4}: extra p99 <= "
            f"{pair['worst_extra_p99_ms']:7.1f} ms, gateway loop lag (median) <= {pair['worst_loop_lag_ms']:6.1f} ms "
            f"(target {TARGET_EXTRA_MS:.0f}): {pair['target']}"
        )
    return lines


def pair_verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """For each (front end of the big request, request size, other front end): the worst extra
    p99 over the scenarios, and met/missed."""
    pairs: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for scenario in result["scenarios"]:
        size = "4 MiB" if scenario["request"].endswith(("at-limit", "many")) else "64 MiB"
        lag = (scenario.get("gateway_loop_lag_ms") or {}).get("median") or 0.0
        for name, stats in scenario["small"].items():
            if "target" in stats:
                key = (size, scenario["front_end"], name)
                pairs.setdefault(key, []).append((stats["extra_p99_ms"], lag))
    verdicts = []
    for (size, big, small_name), values in sorted(
        pairs.items(), key=lambda item: (item[0][0] != "64 MiB", item[0])
    ):
        worst = max(extra for extra, _ in values)
        verdicts.append(
            {
                "size": size,
                "big": big,
                "small": small_name,
                "worst_extra_p99_ms": worst,
                "worst_loop_lag_ms": max(lag for _, lag in values),
                "target": "met" if worst <= TARGET_EXTRA_MS else "missed",
            }
        )
    return verdicts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--send", nargs=3, metavar=("FRONT_END", "ADDRESS", "KIND"), help=argparse.SUPPRESS)
    parser.add_argument("--small", nargs=2, metavar=("FRONT_END", "ADDRESS"), help=argparse.SUPPRESS)
    parser.add_argument("--label", default="after")
    parser.add_argument(
        "--arrangements", default="process,loop", help="process, loop or both (comma-separated)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="big requests (windows) per scenario")
    parser.add_argument("--settle-s", type=float, default=1.5, help="measured time after each big reply")
    parser.add_argument("--only", default="", help="comma-separated scenario names (front_end:kind)")
    args = parser.parse_args()
    if args.send:
        sender(*args.send)
        return 0
    if args.small:
        small(*args.small)
        return 0
    plan = PLAN
    if args.only:
        wanted = set(args.only.split(","))
        plan = [step for step in plan if f"{step[0]}:{step[1]}" in wanted]
    results = []
    for arrangement in args.arrangements.split(","):
        print(f"starting the suite (gRPC front end: {arrangement})…", flush=True)
        result = run_arrangement(arrangement, plan, args)
        results.append({**result, "pairs": pair_verdicts(result)})
    for result in results:
        print("\n".join(report(result)))
    path = write_result(
        f"gateway_big_request_{args.label}",
        {
            "small_clients": {
                "http": "tritonclient[http]",
                "grpc": "tritonclient[grpc]",
                "edge": "zmq DEALER, edge protocol",
                "model": SMALL_MODEL,
                "period_ms": PERIOD_S * 1000,
                "latency_from": "each request's scheduled send time",
            },
            "big_requests_to": BIG_MODEL,
            "repeat": args.repeat,
            "target_extra_p99_ms": TARGET_EXTRA_MS,
            "arrangements": results,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
