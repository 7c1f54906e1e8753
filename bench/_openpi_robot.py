"""openpi's stock client (openpi-client, run in .venv-openpi) timing a policy server for
bench/robot_clients.py; prints one JSON line.

    _openpi_robot.py URL latency CALLS          one robot: round-trip seconds of each call
    _openpi_robot.py URL fleet ROBOTS SECONDS   robots in threads, as fast as answered: calls/s
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy

WARMUP = 50


def main() -> None:
    url, mode, first, second = [*sys.argv[1:], "", ""][:4]
    if mode == "latency":
        policy = WebsocketClientPolicy(url)
        state = np.random.default_rng(0).standard_normal(32).astype(np.float32)
        for _ in range(WARMUP):
            policy.infer({"state": state})
        samples = []
        for _ in range(int(first)):
            started = time.perf_counter()
            policy.infer({"state": state})
            samples.append(time.perf_counter() - started)
        print(json.dumps({"samples_s": samples}))
    elif mode == "fleet":
        robots, seconds = int(first), float(second)
        policies = [WebsocketClientPolicy(url) for _ in range(robots)]
        for policy in policies:
            policy.infer({"state": np.zeros(32, np.float32)})
        counts = [0] * robots
        stop = time.perf_counter() + seconds

        def drive(index: int) -> None:
            state = np.full(32, index, np.float32)
            while time.perf_counter() < stop:
                policies[index].infer({"state": state})
                counts[index] += 1

        threads = [threading.Thread(target=drive, args=(i,)) for i in range(robots)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
        print(json.dumps({"calls": sum(counts), "seconds": elapsed, "per_robot": counts}))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
