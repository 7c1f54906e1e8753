"""Round-trip latency of `double` through each gateway front end: edge (ZMQ), gRPC and HTTP (KServe v2).

    python bench/frontends_latency.py                  # starts the suite on free ports, 2000 requests each
    python bench/frontends_latency.py --requests 5000
    python bench/frontends_latency.py --grpc-in-loop   # gRPC also without its relay process

Sequential, one request in flight, the same 7 float32 elements for every front end:
  edge  - the stock Inferential client (inferential 1.4.0)
  grpc  - the stock tritonclient[grpc] (`InferenceServerClient.infer`), through the gateway's gRPC
          relay process (the default, `gateway.grpc_process`); with --grpc-in-loop, also on a
          second suite whose gateway serves gRPC on its own loop (`grpc_in_loop`)
  http  - the stock tritonclient[http] (binary tensor data, the client's default)
Writes bench/results/frontends_latency_double.json.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable

import numpy as np
from _harness import percentiles_ms, running_suite_handle, write_result


def _timed(name: str, call: Callable[[], None], *, requests: int, warmup: int) -> list[float]:
    samples: list[float] = []
    for i in range(warmup + requests):
        start = time.perf_counter()
        call()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            samples.append(elapsed)
    print(f"  {name}: {requests} requests done", flush=True)
    return samples


def edge_samples(edge: str, x: np.ndarray, *, requests: int, warmup: int) -> list[float]:
    from inferential import Connection

    conn = Connection(server=edge, client_id=f"bench-{uuid.uuid4().hex[:6]}")
    model = conn.model("double")

    def call() -> None:
        model.observe(x=x)
        result = model.get_result(timeout_ms=5000)
        if result is None or "error" in result:
            raise RuntimeError(f"edge request failed: {result}")

    try:
        return _timed("edge", call, requests=requests, warmup=warmup)
    finally:
        conn.close()


def kserve_samples(protocol: str, address: str, x: np.ndarray, *, requests: int, warmup: int) -> list[float]:
    """`double` through the KServe v2 front end with the stock `tritonclient` of `protocol`
    (`grpc` or `http`)."""
    import importlib

    triton = importlib.import_module(f"tritonclient.{protocol}")
    client = triton.InferenceServerClient(address)
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)

    def call() -> None:
        out = client.infer("double", [tensor]).as_numpy("x")
        if out is None or out[1] != x[1] * 2:
            raise RuntimeError(f"{protocol} request returned a wrong result")

    try:
        return _timed(protocol, call, requests=requests, warmup=warmup)
    finally:
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--size", type=int, default=7, help="float32 elements per request")
    parser.add_argument(
        "--grpc-in-loop",
        action="store_true",
        help="also measure gRPC served on the gateway's loop (gateway.grpc_process: false), on a second suite",
    )
    args = parser.parse_args()
    x = np.arange(args.size, dtype=np.float32)
    results: dict[str, dict[str, float]] = {}
    with running_suite_handle(preload=["double"]) as suite:
        gateway = suite.settings.gateway
        kwargs = {"requests": args.requests, "warmup": args.warmup}
        results["edge"] = percentiles_ms(edge_samples(gateway.edge.bind, x, **kwargs))
        results["grpc"] = percentiles_ms(kserve_samples("grpc", gateway.address, x, **kwargs))
        results["http"] = percentiles_ms(
            kserve_samples("http", f"{gateway.http_host}:{gateway.http_port}", x, **kwargs)
        )
    if args.grpc_in_loop:  # the relay process's cost: one more local hop per call
        with running_suite_handle(
            preload=["double"], overrides={"gateway": {"grpc_process": False}}
        ) as suite:
            results["grpc_in_loop"] = percentiles_ms(
                kserve_samples("grpc", suite.settings.gateway.address, x, **kwargs)
            )
    path = write_result(
        "frontends_latency_double" + ("_grpc-in-loop" if args.grpc_in_loop else ""),
        {
            "model": "double",
            "elements": args.size,
            "sequential": True,
            "clients": {
                "edge": "inferential 1.4.0",
                "grpc": "tritonclient[grpc]",
                "http": "tritonclient[http]",
            },
            "front_ends": results,
        },
    )
    for name, stats in results.items():
        print(f"{name:>5}: p50 {stats['p50_ms']} ms, p99 {stats['p99_ms']} ms over {stats['count']} requests")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
