"""The GR00T reference for bench/robot_clients.py: a plain single-threaded REQ/REP loop with
GR00T's msgpack coding (as gr00t/policy/server_client.py's PolicyServer, without its prints)
serving the TorchScript `policy` inline.

    _gr00t_reference.py ENDPOINT
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"


def encode(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=False)
        return {"__ndarray_class__": True, "as_npy": buffer.getvalue()}
    return value


def decode(value: dict[Any, Any]) -> Any:
    if "__ndarray_class__" in value:
        return np.load(io.BytesIO(value["as_npy"]), allow_pickle=False)
    return value


def main() -> None:
    torch.set_num_threads(1)
    module = torch.jit.load(str(MODELS / "policy" / "artifacts" / "policy.pt")).eval()
    socket = zmq.Context().socket(zmq.REP)
    socket.bind(sys.argv[1])
    while True:
        request = msgpack.unpackb(socket.recv(), object_hook=decode)
        try:
            endpoint = request.get("endpoint", "get_action")
            if endpoint == "ping":
                result: Any = {"status": "ok", "message": "Server is running"}
            else:
                observation = request["data"]["observation"]
                with torch.inference_mode():
                    action = module(torch.from_numpy(np.asarray(observation["state"], np.float32)))
                result = [{"action": action.numpy()}, {}]
            socket.send(msgpack.packb(result, default=encode))
        except Exception as error:
            socket.send(msgpack.packb({"error": str(error)}))


if __name__ == "__main__":
    main()
