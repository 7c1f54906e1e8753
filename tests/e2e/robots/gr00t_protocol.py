"""A GR00T policy client written from the protocol (NVIDIA Isaac-GR00T's
gr00t/policy/server_client.py): one REQ socket, msgpack frames, numpy arrays as np.save
bytes under `__ndarray_class__`, errors as {"error": ...} raised as RuntimeError."""

from __future__ import annotations

import io
from typing import Any

import msgpack
import numpy as np
import zmq


def _encode(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=False)
        return {"__ndarray_class__": True, "as_npy": buffer.getvalue()}
    return value


def _decode(value: dict[Any, Any]) -> Any:
    if "__ndarray_class__" in value:
        return np.load(io.BytesIO(value["as_npy"]), allow_pickle=False)
    return value


def pack(value: Any) -> bytes:
    return msgpack.packb(value, default=_encode)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, object_hook=_decode)


class Gr00tClient:
    def __init__(self, endpoint: str, *, api_token: str | None = None, timeout_ms: int = 15_000) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.REQ)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
        self.socket.connect(endpoint)
        self.api_token = api_token

    def call(self, endpoint: str, data: Any = None, *, requires_input: bool = True) -> Any:
        request: dict[str, Any] = {"endpoint": endpoint}
        if requires_input:
            request["data"] = data
        if self.api_token:
            request["api_token"] = self.api_token
        self.socket.send(pack(request))
        response = unpack(self.socket.recv())
        if isinstance(response, dict) and "error" in response:
            raise RuntimeError(f"Server error: {response['error']}")
        return response

    def ping(self) -> Any:
        return self.call("ping", requires_input=False)

    def get_action(
        self, observation: dict[str, Any], options: dict[str, Any] | None = None
    ) -> tuple[Any, Any]:
        action, info = self.call("get_action", {"observation": observation, "options": options})
        return action, info

    def get_modality_config(self) -> Any:
        return self.call("get_modality_config", requires_input=False)

    def reset(self, options: dict[str, Any] | None = None) -> Any:
        return self.call("reset", {"options": options})

    def kill_server(self) -> Any:
        return self.call("kill", requires_input=False)

    def close(self) -> None:
        self.socket.close()
        self.context.term()
