"""NVIDIA Isaac GR00T's policy protocol on a ZeroMQ ROUTER: translation only.

GR00T's `PolicyClient` (gr00t/policy/server_client.py) talks to a REP socket: each request is
one msgpack frame `{"endpoint": ..., "data": ..., "api_token": ...}` and gets one msgpack
frame back; numpy arrays travel as `{"__ndarray_class__": True, "as_npy": <np.save bytes>}`
(read back with `allow_pickle=False`) and failures as `{"error": "..."}`. A ROUTER speaks to
many REQ clients at once, so robots share the model instead of waiting in turn.

Endpoints: `ping` ({"status": "ok", ...}), `get_action` (data `{"observation", "options"}` ->
`[action, info]`), `get_modality_config` (the model config's `modality_config`, in GR00T's
ModalityConfig encoding, else {}) and `reset` ({}). `kill` is refused: no client stops a
shared server. `options` may carry `priority`, `urgency` and `deadline_ms`; anything else in
it is refused by name. With API keys configured, `api_token` must be one (it travels in clear:
beyond loopback, CurveZMQ applies to this socket as to the edge, when configured).

`get_action` maps the observation like openpi's (observations.py) and goes through the one
dispatcher (`client_type` "gr00t"); messages larger than INLINE_FRAME_BYTES are unpacked and
their answers packed on the validation threads. Replies never block: one to a client that
went away is dropped.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import logging
import math
import re
import time
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from loadmaster.common.errors import InternalError, InvalidArgumentError, LoadmasterError
from loadmaster.common.framing import SocketReader, receive_routed
from loadmaster.common.gateway_config import Gr00tSettings, LimitsSettings
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.auth import INFER, Authenticator
from loadmaster.gateway.calls import CallResult
from loadmaster.gateway.curve import EdgeCurve
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.frontends.observations import (
    CallOptions,
    action_dict,
    observation_call,
    parse_options,
)
from loadmaster.gateway.oidc import looks_like_jwt
from loadmaster.gateway.signatures import Signatures
from loadmaster.gateway.validation import off_loop
from loadmaster.v1 import model_pool_pb2

__all__ = ["INLINE_FRAME_BYTES", "Gr00tFrontend", "pack", "unpack"]

log = logging.getLogger(__name__)

INLINE_FRAME_BYTES = 64 << 10
_CLIENT_TYPE = "gr00t"
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_PING = {"status": "ok", "message": "Server is running"}
_ENDPOINTS = ("ping", "get_action", "get_modality_config", "reset")


def _encode(value: Any) -> Any:
    """GR00T's MsgSerializer.encode_custom_classes, for arrays."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "O":  # (np.save would need a pickle)
            value = value.astype(str)
        return {"__ndarray_class__": True, "as_npy": _save_npy(value)}
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot serialize {type(value).__name__}")


def _save_npy(array: np.ndarray) -> bytes:
    """`np.save(..., allow_pickle=False)`'s bytes (format 1.0, the header padded to 64 bytes as
    numpy pads it), written directly for plain dtypes: np.save's own header code costs more
    than a small array's data."""
    if array.dtype.names is not None or array.dtype.subdtype is not None:
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        return buffer.getvalue()
    array = np.ascontiguousarray(array) if array.ndim else array
    header = f"{{'descr': '{array.dtype.str}', 'fortran_order': False, 'shape': {array.shape!r}, }}"
    padding = 64 - (10 + len(header) + 1) % 64
    head = header.encode("latin1") + b" " * (padding % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(head).to_bytes(2, "little") + head + array.tobytes()


# The header np.save writes (format 1.0): "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 32), }"
# padded with spaces. np.load parses it with a literal evaluator (~90 us per array, most of a
# small request's cost here); this reads that exact form, and anything else goes to np.load.
_NPY_HEADER = re.compile(
    rb"\{'descr': '([<>|=][a-zA-Z][0-9]{0,2})', 'fortran_order': (True|False), 'shape': \(([0-9, ]*)\), \}"
)


def _load_npy(data: bytes) -> np.ndarray:
    """`np.load(..., allow_pickle=False)` of np.save bytes, fast for the header np.save writes."""
    if data[:8] == b"\x93NUMPY\x01\x00" and len(data) >= 10:
        header_len = int.from_bytes(data[8:10], "little")
        match = _NPY_HEADER.match(data, 10, 10 + header_len)
        if match is not None:
            dtype = np.dtype(match[1].decode())
            shape = tuple(int(dim) for dim in match[3].split(b",") if dim.strip())
            if not dtype.hasobject:
                count = math.prod(shape)
                start = 10 + header_len
                if len(data) - start != count * dtype.itemsize:
                    raise ValueError(f"{len(data) - start} data bytes for shape {shape} of {dtype}")
                array = np.frombuffer(data, dtype, count, start)
                return array.reshape(shape, order="F" if match[2] == b"True" else "C")
    return np.load(io.BytesIO(data), allow_pickle=False)


def _decode(value: dict[Any, Any]) -> Any:
    """GR00T's MsgSerializer.decode_custom_classes: arrays without pickles."""
    if "__ndarray_class__" in value:
        try:
            return _load_npy(value["as_npy"])
        except (KeyError, TypeError, ValueError, OSError, EOFError) as error:
            raise InvalidArgumentError(
                f"an array of the request is not np.save data: {error}"[:200]
            ) from None
    return value


def pack(value: Any) -> bytes:
    return msgpack.packb(value, default=_encode)


def unpack(data: bytes | memoryview) -> Any:
    try:
        return msgpack.unpackb(data, object_hook=_decode, strict_map_key=False)
    except InvalidArgumentError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData) as error:
        raise InvalidArgumentError(f"the request is not msgpack: {error}"[:200]) from None


def _error(error: LoadmasterError) -> bytes:
    return pack({"error": f"{error.edge_code}: {error.message}"})


class Gr00tFrontend:
    def __init__(
        self,
        settings: Gr00tSettings,
        dispatcher: Dispatcher,
        signatures: Signatures,
        auth: Authenticator,
        limits: LimitsSettings,
        context: zmq.asyncio.Context,
        telemetry: TelemetryReporter,
        *,
        gateway_id: str,
        curve: EdgeCurve | None = None,
    ) -> None:
        self._settings = settings
        self._model_id = settings.model
        self._dispatcher = dispatcher
        self._signatures = signatures
        self._auth = auth
        self._limits = limits
        self._context = context
        self._telemetry = telemetry
        self._curve = curve
        self._ids = (f"{gateway_id}-g{n}" for n in itertools.count(1))
        self._socket: zmq.Socket[Any] | None = None
        self._reader: SocketReader | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.endpoint = ""

    async def start(self) -> None:
        socket: zmq.Socket[Any] = zmq.Socket(self._context, zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_HANDOVER, 0)
        if self._curve is not None:
            self._curve.apply(socket)
        try:
            socket.bind(self._settings.bind)
        except zmq.ZMQError as error:
            socket.close(linger=0)
            raise RuntimeError(f"GR00T front end could not bind {self._settings.bind}: {error}") from None
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket = socket
        self._reader = SocketReader(socket, self._handle, name="gr00t", receive=receive_routed)
        self._reader.start()
        log.info("GR00T front end listening on %s, serving %s", self.endpoint, self._model_id)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    # ---- receiving, on the loop ------------------------------------------------------

    def _handle(self, frames: list[Any]) -> None:
        if len(frames) != 3 or len(frames[1]):  # a REQ's [identity, b"", request]
            self._telemetry.record("observation_errors", 1, {"code": "invalid_argument", "protocol": "gr00t"})
            if frames and len(frames) >= 2:
                self._reply(
                    frames[0], _error(InvalidArgumentError("one request frame expected (a REQ socket)"))
                )
            return
        identity, body = frames[0], frames[2].buffer
        if len(body) > INLINE_FRAME_BYTES:
            self._spawn(self._serve_off_loop(identity, frames[2]))
            return
        try:
            request = unpack(body)
        except LoadmasterError as error:
            self._reply(identity, _error(error))
            return
        self._serve(identity, request)

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_off_loop(self, identity: bytes, frame: zmq.Frame) -> None:
        try:
            request = await off_loop(unpack, frame.buffer)
        except LoadmasterError as error:
            self._reply(identity, _error(error))
            return
        self._serve(identity, request)

    def _serve(self, identity: bytes, request: Any) -> None:
        """One unpacked request: checked, then answered now or when its call ends."""
        try:
            if not isinstance(request, Mapping):
                raise InvalidArgumentError(f"a request is a dict (map), not {type(request).__name__}")
            token = request.get("api_token")
            if token is not None and not isinstance(token, str):
                raise InvalidArgumentError("api_token must be a string")
            if token and looks_like_jwt(token):  # OIDC verification may fetch keys: off this path
                self._spawn(self._serve_verified(identity, request, token))
                return
            self._auth.authorize(token, INFER)
            self._endpoint(identity, request)
        except LoadmasterError as error:
            self._reply(identity, _error(error))

    async def _serve_verified(self, identity: bytes, request: Mapping[str, Any], token: str) -> None:
        try:
            await self._auth.authenticate(token, INFER)
            self._endpoint(identity, request)
        except LoadmasterError as error:
            self._reply(identity, _error(error))

    def _endpoint(self, identity: bytes, request: Mapping[str, Any]) -> None:
        endpoint = request.get("endpoint", "get_action")  # GR00T's server defaults to it
        if endpoint == "get_action":
            self._get_action(identity, request.get("data"))
        elif endpoint == "ping":
            self._reply(identity, pack(_PING))
        elif endpoint == "reset":
            self._reply(identity, pack({}))
        elif endpoint == "get_modality_config":
            self._spawn(self._modality_config(identity))
        elif endpoint == "kill":
            raise InvalidArgumentError(
                "endpoint 'kill' is refused: this server is shared, no client can stop it"
            )
        else:
            raise InvalidArgumentError(f"unknown endpoint {str(endpoint)[:40]!r} ({', '.join(_ENDPOINTS)})")

    async def _modality_config(self, identity: bytes) -> None:
        try:
            signature = await self._signatures.get(self._model_id)
        except LoadmasterError as error:
            self._reply(identity, _error(error))
            return
        configs = json.loads(signature.modality_config_json) if signature.modality_config_json else {}
        self._reply(
            identity,
            pack(
                {
                    name: {"__ModalityConfig_class__": True, "as_json": fields}
                    for name, fields in configs.items()
                }
            ),
        )

    # ---- get_action --------------------------------------------------------------------

    def _get_action(self, identity: bytes, data: Any) -> None:
        if not isinstance(data, Mapping) or "observation" not in data:
            raise InvalidArgumentError('get_action takes data {"observation": {...}, "options": {...}}')
        options = data.get("options") or {}
        if not isinstance(options, Mapping):
            raise InvalidArgumentError("options must be a dict (map) or null")
        call_options = CallOptions(
            client_id=f"gr00t-{bytes(identity).hex()}",
            client_type=_CLIENT_TYPE,
            **parse_options(options, where="option"),
        )
        signature = self._signatures.cached(self._model_id)
        if signature is None:  # fetched first (at most every few seconds), off this callback
            self._spawn(self._act_when_known(identity, data["observation"], call_options))
            return
        self._act(identity, data["observation"], call_options, signature)

    async def _act_when_known(self, identity: bytes, observation: Any, options: CallOptions) -> None:
        try:
            signature = await self._signatures.get(self._model_id)
            self._act(identity, observation, options, signature)
        except LoadmasterError as error:
            self._reply(identity, _error(error))

    def _act(
        self,
        identity: bytes,
        observation: Any,
        options: CallOptions,
        signature: model_pool_pb2.ModelSignature,
    ) -> None:
        """Map the observation and submit it; the reply goes out from the call's result."""
        started = time.monotonic()
        call, batched = observation_call(
            observation,
            signature,
            model_id=self._model_id,
            request_id=next(self._ids),
            options=options,
            limits=self._limits,
        )

        def on_result(result: CallResult) -> None:
            if result.error is not None:
                self._reply(identity, _error(result.error))
                return
            info = {
                "model": self._model_id,
                "server_timing": {
                    "infer_ms": result.inference_latency_ms,
                    "total_ms": (time.monotonic() - started) * 1000.0,
                },
            }
            if sum(output.byte_length for output in result.outputs) > INLINE_FRAME_BYTES:
                self._spawn(self._answer_off_loop(identity, result, batched, info))
                return
            self._send_answer(identity, result, batched, info)

        self._dispatcher.submit(call, on_result)

    async def _answer_off_loop(
        self, identity: bytes, result: CallResult, batched: bool, info: dict[str, Any]
    ) -> None:
        try:
            reply = await off_loop(_answer, result, batched, info)
        except LoadmasterError as error:
            reply = _error(error)
        except Exception as error:  # a bug: logged, and the client answered
            log.exception("GR00T answer failed", extra={"model": self._model_id})
            reply = _error(InternalError(f"internal error: {type(error).__name__}"))
        self._reply(identity, reply)

    def _send_answer(self, identity: bytes, result: CallResult, batched: bool, info: dict[str, Any]) -> None:
        try:
            reply = _answer(result, batched, info)
        except LoadmasterError as error:
            reply = _error(error)
        except Exception as error:  # a bug: logged, and the client answered
            log.exception("GR00T answer failed", extra={"model": self._model_id})
            reply = _error(InternalError(f"internal error: {type(error).__name__}"))
        self._reply(identity, reply)

    def _reply(self, identity: bytes, body: bytes) -> None:
        socket = self._socket
        if socket is None:
            return
        try:
            socket.send(identity, _MORE_NOBLOCK)
            socket.send(b"", _MORE_NOBLOCK)
            socket.send(body, _NOBLOCK, copy=len(body) < INLINE_FRAME_BYTES)
        except zmq.ZMQError as error:  # the client is gone or not reading: drop, never block
            log.debug("GR00T reply to %r dropped: %s", identity, error)
        if self._reader is not None:
            self._reader.sent()


def _answer(result: CallResult, batched: bool, info: dict[str, Any]) -> bytes:
    return pack([action_dict(result, unbatch=batched), info])
