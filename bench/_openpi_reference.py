"""The reference for bench/robot_clients.py: openpi's own server (openpi-server from PyPI,
run in .venv-openpi) serving a policy inline in its connection handler, as its code does.

    _openpi_reference.py PORT policy      the TorchScript `policy` (examples/models), 1 torch thread
    _openpi_reference.py PORT slow        a 10 ms-per-call stand-in (as examples/models/slow-policy)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from openpi_client.base_policy import BasePolicy
from openpi_server import WebsocketPolicyServer

MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"


class TorchPolicy(BasePolicy):
    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)  # as the suite's worker (model_pool.inference_threads: 1)
        self._torch = torch
        self._module = torch.jit.load(str(MODELS / "policy" / "artifacts" / "policy.pt")).eval()

    def infer(self, obs: dict) -> dict:  # type: ignore[override]
        with self._torch.inference_mode():
            state = self._torch.from_numpy(np.asarray(obs["state"], np.float32)[None])
            return {"action": self._module(state)[0].numpy()}


class SlowPolicy(BasePolicy):
    def infer(self, obs: dict) -> dict:  # type: ignore[override]
        time.sleep(0.010)
        return {"action": np.tanh(np.asarray(obs["state"], np.float32)[:8])}


def main() -> None:
    port, kind = int(sys.argv[1]), sys.argv[2]
    policy = TorchPolicy() if kind == "policy" else SlowPolicy()
    WebsocketPolicyServer(
        policy, host="127.0.0.1", port=port, metadata={"server": "openpi-server"}
    ).serve_forever()


if __name__ == "__main__":
    main()
