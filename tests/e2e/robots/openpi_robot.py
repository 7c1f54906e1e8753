"""Robots with openpi's stock client, run in .venv-openpi (openpi-client pins numpy < 2) by
tests/e2e/test_robot_clients.py. Each mode prints one JSON line of results.

    python openpi_robot.py URL infer STATE.npy OUT.npy [API_KEY]
    python openpi_robot.py URL error
    python openpi_robot.py URL fleet ROBOTS CALLS
    python openpi_robot.py URL wait-then-sleep MS [API_KEY]   (prints "ready", waits for a line on stdin)
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy


def main() -> None:
    url, mode, *args = sys.argv[1:]
    if mode == "infer":
        policy = WebsocketClientPolicy(url, api_key=args[2] if len(args) > 2 else None)
        state = np.load(args[0])
        action = policy.infer({"state": state})
        np.save(args[1], action["action"])
        print(
            json.dumps({"metadata": policy.get_server_metadata(), "server_timing": action["server_timing"]})
        )
    elif mode == "error":
        policy = WebsocketClientPolicy(url)
        try:
            policy.infer({"state": np.zeros(32, np.float32), "prompt": "pick up the cup"})
            print(json.dumps({"error": None}))
        except RuntimeError as error:
            closed = None
            try:
                policy._ws.recv(timeout=5)
            except Exception as gone:  # the server closed the connection after the error frame
                closed = getattr(getattr(gone, "rcvd", None), "code", None)
            print(json.dumps({"error": str(error), "close_code": closed}))
    elif mode == "fleet":
        robots, calls = int(args[0]), int(args[1])
        policies = [WebsocketClientPolicy(url) for _ in range(robots)]
        failures: list[str] = []

        def drive(policy: WebsocketClientPolicy, seed: int) -> None:
            state = np.full(32, seed / 10, np.float32)
            for _ in range(calls):
                action = policy.infer({"state": state})["action"]
                if action.shape != (8,) or not np.allclose(action, np.tanh(state[:8]), atol=1e-6):
                    failures.append(f"robot {seed}: {action}")

        for policy in policies:  # one warm call each (connections and the model's first batch)
            policy.infer({"state": np.zeros(32, np.float32)})
        threads = [threading.Thread(target=drive, args=(p, i)) for i, p in enumerate(policies)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(
            json.dumps(
                {"seconds": time.perf_counter() - started, "calls": robots * calls, "failures": failures}
            )
        )
    elif mode == "wait-then-sleep":
        policy = WebsocketClientPolicy(url, api_key=args[1] if len(args) > 1 else None)
        print("ready", flush=True)
        sys.stdin.readline()
        started = time.perf_counter()
        reply = policy.infer({"ms": np.float32(float(args[0]))})
        print(json.dumps({"seconds": time.perf_counter() - started, "ms": float(reply["ms"])}), flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
