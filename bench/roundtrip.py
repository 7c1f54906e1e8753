"""Round-trip latency of `double` through the edge with the stock Inferential client.

    python bench/roundtrip.py                 # starts the suite on free ports, 2000 requests
    python bench/roundtrip.py --edge tcp://127.0.0.1:5555 --requests 5000

Sequential: one observation in flight at a time, as a control loop sends them.
Writes bench/results/roundtrip_double.json.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

import numpy as np
from _harness import percentiles_ms, running_suite, write_result
from inferential import Connection


def measure(edge: str, *, requests: int, warmup: int, model_id: str, size: int) -> list[float]:
    conn = Connection(server=edge, client_id=f"bench-{uuid.uuid4().hex[:6]}")
    model = conn.model(model_id)
    x = np.arange(size, dtype=np.float32)
    samples: list[float] = []
    try:
        for i in range(warmup + requests):
            start = time.perf_counter()
            model.observe(x=x)
            result = model.get_result(timeout_ms=5000)
            elapsed = time.perf_counter() - start
            if result is None or "error" in result:
                raise RuntimeError(f"request {i} failed: {result}")
            if i >= warmup:
                samples.append(elapsed)
            if (i + 1) % 500 == 0:
                print(f"  {i + 1}/{warmup + requests}", flush=True)
    finally:
        conn.close()
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edge", help="edge address of a running suite (default: start one)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--model", default="double")
    parser.add_argument("--size", type=int, default=7, help="float32 elements per observation")
    args = parser.parse_args()
    with running_suite(args.edge, preload=[args.model]) as edge:
        samples = measure(
            edge, requests=args.requests, warmup=args.warmup, model_id=args.model, size=args.size
        )
    stats = percentiles_ms(samples)
    path = write_result(
        f"roundtrip_{args.model}",
        {
            "client": "inferential 1.4.0",
            "model": args.model,
            "elements": args.size,
            "sequential": True,
            **stats,
        },
    )
    print(f"{args.model}: p50 {stats['p50_ms']} ms, p99 {stats['p99_ms']} ms over {stats['count']} requests")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
