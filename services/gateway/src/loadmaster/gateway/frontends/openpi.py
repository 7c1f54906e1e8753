"""openpi's WebSocket policy protocol on the gateway's HTTP port: translation only.

`ws://HOST:PORT/openpi/MODEL[?priority=&urgency=&deadline_ms=&client_id=]`, as the stock
`openpi_client.websocket_client_policy.WebsocketClientPolicy` speaks it (openpi-client on
PyPI): on connect the server sends a metadata dict; then each binary frame is one observation
dict and is answered with one action dict, both msgpack with openpi's numpy encoding
(`{b"__ndarray__": True, b"data", b"dtype", b"shape"}`), the action carrying `server_timing`.
A failure is a text frame with the message, then a close with code 1011 (what openpi's own
server does with its traceback; the client raises on a text frame).

Every observation becomes one call through the dispatcher (observations.py maps the dict onto
the model's inputs), so openpi robots queue with every other client of the model under the
same strategy, deadlines, priorities, batching and metrics (`client_type` "openpi").

Refused at the handshake, before the upgrade: a missing or wrong API key (`Authorization:
Api-Key <key>`, or `Bearer <key>`) with 401/403, an unknown model with 404, and a query
parameter that is unknown or malformed with 400 naming it. The client leaving while its
observation waits cancels it. Frames larger than INLINE_FRAME_BYTES are unpacked and packed
on the validation threads, off the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
from starlette.responses import JSONResponse
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from loadmaster.common.errors import InternalError, InvalidArgumentError, LoadmasterError
from loadmaster.common.gateway_config import LimitsSettings
from loadmaster.gateway.auth import INFER, Authenticator
from loadmaster.gateway.calls import CallResult
from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.frontends.observations import (
    CallOptions,
    action_dict,
    observation_call,
    parse_options,
)
from loadmaster.gateway.kserve_calls import tensor_metadata
from loadmaster.gateway.signatures import Signatures
from loadmaster.gateway.validation import off_loop
from loadmaster.v1 import model_pool_pb2

__all__ = ["CLOSE_ERROR", "INLINE_FRAME_BYTES", "openpi_routes", "pack", "unpack"]

log = logging.getLogger(__name__)

CLOSE_ERROR = 1011  # websockets.frames.CloseCode.INTERNAL_ERROR, as openpi's server closes
INLINE_FRAME_BYTES = 64 << 10  # frames up to this size are (un)packed on the event loop
_CLIENT_TYPE = "openpi"
_MAX_REASON = 120  # a close reason is at most 123 bytes


def _pack_numpy(value: Any) -> Any:
    """openpi's msgpack_numpy encoding (openpi_client/msgpack_numpy.py)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "VOc":
            raise InvalidArgumentError(f"an output of dtype {value.dtype} cannot be sent to openpi")
        return {
            b"__ndarray__": True,
            b"data": value.tobytes(),
            b"dtype": value.dtype.str,
            b"shape": value.shape,
        }
    if isinstance(value, np.generic):
        return {b"__npgeneric__": True, b"data": value.item(), b"dtype": value.dtype.str}
    raise TypeError(f"cannot serialize {type(value).__name__}")


def _unpack_numpy(value: dict[Any, Any]) -> Any:
    if b"__ndarray__" in value:
        try:
            dtype = np.dtype(value[b"dtype"])
            if dtype.hasobject:  # pointers read from a client's bytes: never
                raise ValueError(f"dtype {dtype} holds Python objects")
            return np.ndarray(buffer=value[b"data"], dtype=dtype, shape=tuple(value[b"shape"]))
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidArgumentError(f"an array of the observation is malformed: {error}"[:200]) from None
    if b"__npgeneric__" in value:
        try:
            dtype = np.dtype(value[b"dtype"])
            if dtype.hasobject:
                raise ValueError(f"dtype {dtype} holds Python objects")
            return dtype.type(value[b"data"])
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidArgumentError(f"a scalar of the observation is malformed: {error}"[:200]) from None
    return value


def pack(value: Any) -> bytes:
    return msgpack.packb(value, default=_pack_numpy)


def unpack(data: bytes, *, max_bytes: int) -> Any:
    """One frame -> its value; `InvalidArgumentError` for anything that is not msgpack. Object
    dtypes are refused (numpy would need pickles for them)."""
    try:
        return msgpack.unpackb(
            data,
            object_hook=_unpack_numpy,
            strict_map_key=False,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
        )
    except InvalidArgumentError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData) as error:
        raise InvalidArgumentError(f"the observation is not msgpack: {error}"[:200]) from None


def _token(header: str | None) -> str | None:
    """The key of `Authorization: Api-Key <key>` (openpi's client) or `Bearer <key>`."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() not in ("api-key", "bearer") or not token.strip():
        return None
    return token.strip()


def openpi_routes(
    dispatcher: Dispatcher,
    signatures: Signatures,
    auth: Authenticator,
    limits: LimitsSettings,
    *,
    gateway_id: str,
) -> list[WebSocketRoute]:
    connections = itertools.count(1)
    requests = itertools.count(1)
    max_frame = limits.max_payload_bytes + limits.max_envelope_bytes

    async def refuse(websocket: WebSocket, error: LoadmasterError) -> None:
        """An HTTP answer instead of the upgrade (WebSocket denial response)."""
        await websocket.send_denial_response(
            JSONResponse({"error": error.message}, status_code=error.http_status)
        )

    async def endpoint(websocket: WebSocket) -> None:
        model_id = websocket.path_params["model"]
        connection = next(connections)
        try:
            await auth.authenticate(_token(websocket.headers.get("authorization")), INFER)
            query = dict(websocket.query_params)
            # One robot per connection unless it names itself (several may share an API key).
            client_id = query.pop("client_id", "") or f"openpi-{gateway_id}-{connection}"
            options = CallOptions(
                client_id=client_id,
                client_type=_CLIENT_TYPE,
                connection_bound=True,
                **parse_options(query, where="query parameter"),
            )
            signature = await signatures.get(model_id)
        except LoadmasterError as error:
            await refuse(websocket, error)
            return
        await websocket.accept()
        try:
            await websocket.send_bytes(pack(_metadata(model_id, signature)))
            await _serve(websocket, model_id, signature, options)
        except WebSocketDisconnect:
            pass
        except LoadmasterError as error:
            await _fail(websocket, error)
        except Exception as error:  # a bug: logged, and the client told, never left waiting
            log.exception("openpi connection to %s failed", model_id, extra={"model": model_id})
            await _fail(websocket, InternalError(f"internal error: {type(error).__name__}"))

    async def _serve(
        websocket: WebSocket,
        model_id: str,
        signature: model_pool_pb2.ModelSignature,
        options: CallOptions,
    ) -> None:
        """Observations in, actions out, one at a time, until the client leaves or fails."""
        receiving: asyncio.Future[Any] = asyncio.ensure_future(websocket.receive())
        previous_total_ms: float | None = None
        while True:
            message = await receiving
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes")
            if data is None:
                raise InvalidArgumentError("observations are binary (msgpack) frames, not text")
            started = time.monotonic()
            request_id = f"{gateway_id}-o{next(requests)}"
            if len(data) > INLINE_FRAME_BYTES:
                call, batched = await off_loop(_prepare, data, model_id, signature, options, request_id)
            else:
                call, batched = _prepare(data, model_id, signature, options, request_id)
            del data, message
            result = await _dispatch(websocket, call)
            if result is None:  # the client left while it waited (the call is cancelled)
                return
            receiving = result[1]
            timing = {"infer_ms": result[0].inference_latency_ms}
            if previous_total_ms is not None:
                timing["prev_total_ms"] = previous_total_ms
            if sum(output.byte_length for output in result[0].outputs) > INLINE_FRAME_BYTES:
                reply = await off_loop(_answer, result[0], batched, timing)
            else:
                reply = _answer(result[0], batched, timing)
            await websocket.send_bytes(reply)
            previous_total_ms = (time.monotonic() - started) * 1000.0

    async def _dispatch(websocket: WebSocket, call: Any) -> tuple[CallResult, asyncio.Future[Any]] | None:
        """Submit the call while listening for the client's next message: the client leaving
        cancels the call (None); else (the result, the receive of the next message)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[CallResult] = loop.create_future()
        left = False

        def on_result(result: CallResult) -> None:
            if not done.done():
                done.set_result(result)

        def on_message(receiving: asyncio.Future[Any]) -> None:
            nonlocal left
            if receiving.cancelled() or receiving.exception() is not None:
                return
            if receiving.result()["type"] == "websocket.disconnect" and not done.done():
                left = True
                dispatcher.cancel(call.request_id)  # (it answers nothing once cancelled)
                done.cancel()
            # else: a client that sends before its answer came (openpi's does not): in turn

        dispatcher.submit(call, on_result)
        receiving: asyncio.Future[Any] = asyncio.ensure_future(websocket.receive())
        receiving.add_done_callback(on_message)
        try:
            result = await done
        except asyncio.CancelledError:
            if left:
                return None
            receiving.cancel()
            dispatcher.cancel(call.request_id)
            raise
        if result.error is not None:
            receiving.cancel()
            raise result.error
        return result, receiving

    def _prepare(
        data: bytes,
        model_id: str,
        signature: model_pool_pb2.ModelSignature,
        options: CallOptions,
        request_id: str,
    ) -> tuple[Any, bool]:
        observation = unpack(data, max_bytes=max_frame)
        if not isinstance(observation, Mapping):
            raise InvalidArgumentError(f"an observation is a dict (map), not {type(observation).__name__}")
        return observation_call(
            observation, signature, model_id=model_id, request_id=request_id, options=options, limits=limits
        )

    return [WebSocketRoute("/openpi/{model}", endpoint)]


def _answer(result: CallResult, batched: bool, timing: dict[str, float]) -> bytes:
    action = action_dict(result, unbatch=batched)
    action["server_timing"] = timing
    return pack(action)


def _metadata(model_id: str, signature: model_pool_pb2.ModelSignature) -> dict[str, Any]:
    """What a client gets on connect (openpi's `get_server_metadata()`)."""

    def listed(specs: Any) -> list[dict[str, Any]]:
        return [
            {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in tensor_metadata(specs)
        ]

    return {
        "server": "loadmaster",
        "model": model_id,
        "version": "1",
        "backend": signature.backend,
        "inputs": listed(signature.inputs),
        "outputs": listed(signature.outputs),
    }


async def _fail(websocket: WebSocket, error: LoadmasterError) -> None:
    """openpi's error reply: the message as a text frame, then a close (code 1011)."""
    text = f"{error.edge_code}: {error.message}"
    try:
        await websocket.send_text(text)
        await websocket.close(code=CLOSE_ERROR, reason=text.encode()[:_MAX_REASON].decode(errors="ignore"))
    except (WebSocketDisconnect, RuntimeError):
        pass  # the client is gone already
