"""The gateway's public gRPC address served by a process of its own, relaying to the gateway.

Why a process: grpcio copies every message it receives into one Python bytes object with the
GIL held, on the thread that serves the call. On the gateway's event loop, one 64 MiB
`ModelInfer` held every other front end for 150-300 ms; a gRPC server on a thread of its own
(its own event loop, or grpcio's thread pool) still held the loop 40-190 ms, because the copy
holds the GIL and a busy machine deschedules the thread holding it. In a process of its own the
gateway's loop saw at most ~12 ms (docs/frontend-isolation.md has the measurements).

How: `GrpcRelay` (in the gateway) moves the gateway's gRPC server (KServe v2, health,
reflection) to a unix socket in a private folder and starts this module as a child process,
which binds the public address and relays every call there as raw bytes: metadata (less the
transport's own headers), deadline, cancellation, status, details and initial and trailing
metadata pass through, so the servicers, interceptors, auth and error mapping of the gateway
run unchanged. An infer message over `LARGE_MESSAGE_BYTES` goes through shared memory instead
(`grpc_handoff`): the gateway maps it and never receives it through grpcio. A small call pays
one more local hop.

The child binds the public address and says so on stdout (`{"port": N}`), then serves until
its stdin closes: the gateway closes it to stop it, and a gateway that died closes it too (and
the kernel kills it then: PR_SET_PDEATHSIG). It ignores SIGINT and SIGTERM (they reach the
whole process group), so the gateway decides when it stops: after its own server drained, so
calls in flight are answered. A child that dies is started again.

    python -m loadmaster.gateway.frontends.grpc_relay   # config: one JSON line on stdin
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from loadmaster.common import internal_auth, transport
from loadmaster.common.child_processes import die_with_parent
from loadmaster.common.service import loop_factory
from loadmaster.common.shm import SHM_DIRECTORY
from loadmaster.gateway.frontends import grpc_handoff

__all__ = ["GrpcRelay", "RelayConfig", "RelayHandler", "method_kinds"]

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # the child imports grpcio and binds: seconds on a loaded machine
RESTART_DELAY_S = 1.0
STOP_SLACK_S = 5.0
SWEEP_INTERVAL_S = 30.0  # shared-memory messages nobody read (their client left) are removed
_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
# Headers of the transport, not of the call: gRPC sets them itself on the relayed call.
_RESERVED = ("grpc-", ":")
_RESERVED_KEYS = frozenset({"te", "content-type", "user-agent", "host"})
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
_MAX_PENDING_MARKERS = 64  # a long stream forgets markers the gateway took past this many


def method_kinds(services: Sequence[Any], *, bidi: Sequence[str] = ()) -> dict[str, str]:
    """Each method of the service descriptors -> its kind (`unary_unary` ...); `bidi` names
    services whose one method is a bidirectional stream but whose descriptor is not at hand."""
    kinds: dict[str, str] = {}
    for service in services:
        for method in service.methods:
            kind = ("stream_" if method.client_streaming else "unary_") + (
                "stream" if method.server_streaming else "unary"
            )
            kinds[f"/{service.full_name}/{method.name}"] = kind
    for name in bidi:
        kinds[f"/{name}/ServerReflectionInfo"] = "stream_stream"
    return kinds


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """What the child needs, sent as one JSON line on its stdin."""

    listen: str
    upstream: str  # the gateway's gRPC server: unix:<path>
    methods: dict[str, str]  # method path -> kind; others are UNIMPLEMENTED
    handoff_methods: list[str]  # their large messages go through shared memory
    large_message_bytes: int
    options: list[tuple[str, Any]] = field(default_factory=list)
    grace_s: float = 30.0
    log_level: str = "INFO"
    log_format: str = "logfmt"
    tls_cert: str = ""  # PEM: the public address takes TLS when set
    tls_key: str = ""
    shm_directory: str = str(SHM_DIRECTORY)


def _forwarded(metadata: Sequence[tuple[str, Any]] | None) -> tuple[tuple[str, Any], ...]:
    return tuple(
        (key, value)
        for key, value in metadata or ()
        if not key.startswith(_RESERVED) and key not in _RESERVED_KEYS
    )


class RelayHandler(grpc.GenericRpcHandler):
    """Relays each call of `config.methods` to `channel`, bytes in and bytes out."""

    def __init__(self, channel: grpc.aio.Channel, config: RelayConfig) -> None:
        self._channel = channel
        self._config = config
        self._directory = Path(config.shm_directory)
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        handler = self._handlers.get(method)
        if handler is None:
            kind = self._config.methods.get(method)
            if kind not in _KINDS:
                return None  # gRPC answers UNIMPLEMENTED, as the gateway would
            handler = self._handlers[method] = self._handler(method)
        return handler

    # -- messages in: large infer messages through shared memory ---------------------------

    async def _outgoing(self, method: str, message: bytes, markers: list[bytes]) -> bytes:
        if method not in self._config.handoff_methods:
            return message
        if len(message) > self._config.large_message_bytes:
            marker = await asyncio.to_thread(grpc_handoff.hand_off, [message], directory=self._directory)
            if marker is not None:
                if len(markers) >= _MAX_PENDING_MARKERS:
                    markers[:] = [m for m in markers if (self._directory / m[1:].decode()).exists()]
                markers.append(marker)
                return marker
        return grpc_handoff.neutralize(message)

    async def _incoming(self, method: str, response: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """A large reply comes as a marker: the relay reads it off the loop."""
        if method not in self._config.handoff_methods or not grpc_handoff.is_marker(response):
            return response
        try:
            return await asyncio.to_thread(grpc_handoff.read, response, directory=self._directory)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INTERNAL, f"the gateway's reply could not be read: {error}")
            raise  # (abort raises)

    def _discard(self, markers: list[bytes]) -> None:
        for marker in markers:
            grpc_handoff.discard(marker, directory=self._directory)

    # -- the four kinds ------------------------------------------------------------------

    def _relay(self, method: str) -> tuple[Callable[..., Any], bool, bool]:
        """The upstream call for `method` and whether its requests and its responses stream."""
        kind = self._config.methods[method]
        requests, responses = kind.split("_")
        return getattr(self._channel, kind)(method), requests == "stream", responses == "stream"

    async def _call(
        self,
        relay: Callable[..., Any],
        method: str,
        request: Any,
        streaming: bool,
        context: grpc.aio.ServicerContext,
        markers: list[bytes],
    ) -> Any:
        """Open the relayed call: the request (or each streamed one) on its way out, the
        client's metadata less the transport's own, and what is left of its deadline."""
        outgoing = (
            self._messages(method, request, markers)
            if streaming
            else await self._outgoing(method, request, markers)
        )
        return relay(
            outgoing, metadata=_forwarded(context.invocation_metadata()), timeout=context.time_remaining()
        )

    def _handler(self, method: str) -> grpc.RpcMethodHandler:
        relay, streamed_requests, streamed_responses = self._relay(method)

        async def answer(request: Any, context: grpc.aio.ServicerContext) -> bytes:
            markers: list[bytes] = []
            try:
                call = await self._call(relay, method, request, streamed_requests, context, markers)
                del request  # a 64 MiB message is not held while the answer comes
                response: bytes = await _answered(call, context)
                await _pass_metadata(call, context)
                return await self._incoming(method, response, context)
            finally:
                self._discard(markers)

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            markers: list[bytes] = []
            try:
                call = await self._call(relay, method, request, streamed_requests, context, markers)
                del request
                async with contextlib.aclosing(_streamed(call, context)) as responses:
                    async for response in responses:
                        yield await self._incoming(method, response, context)
            finally:
                self._discard(markers)

        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(streamed_requests, streamed_responses)]
        return make(stream if streamed_responses else answer)

    async def _messages(
        self, method: str, requests: AsyncIterator[bytes], markers: list[bytes]
    ) -> AsyncIterator[bytes]:
        async for message in requests:
            yield await self._outgoing(method, message, markers)


async def _answered(call: Any, context: grpc.aio.ServicerContext) -> Any:
    """The relayed call's response; its failure becomes this call's (status, details, trailers)."""
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        await _abort(context, error)
    except asyncio.CancelledError:  # the client went away: so does the relayed call
        call.cancel()
        raise


async def _streamed(call: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator[Any, None]:
    """The relayed call's responses. However this ends before the call does (the client went
    away, or the handler was closed while it waited at a `yield`), the relayed call is
    cancelled: left open, it would hold the gateway's drain until the grace ran out."""
    try:
        first = True
        async for response in call:
            if first:
                first = False
                await _pass_metadata(call, context, trailing=False)
            yield response
    except grpc.aio.AioRpcError as error:
        await _abort(context, error)
    finally:
        if not call.done():
            call.cancel()
    await _pass_metadata(call, context, initial=False)


async def _pass_metadata(
    call: Any, context: grpc.aio.ServicerContext, *, initial: bool = True, trailing: bool = True
) -> None:
    if initial:
        sent = _forwarded(await call.initial_metadata())
        if sent:
            await context.send_initial_metadata(sent)
    if trailing:
        trailers = _forwarded(await call.trailing_metadata())
        if trailers:
            context.set_trailing_metadata(trailers)


async def _abort(context: grpc.aio.ServicerContext, error: grpc.aio.AioRpcError) -> None:
    await context.abort(error.code(), error.details() or "", _forwarded(error.trailing_metadata()))


# -- the gateway's side ----------------------------------------------------------------------


class GrpcRelay:
    """Starts the relay process on `listen` once the gateway's server serves `upstream`, starts
    it again if it dies, and stops it (closing its stdin) after the gateway's server stopped."""

    def __init__(
        self,
        listen: str,
        *,
        methods: dict[str, str],
        handoff_methods: Sequence[str],
        large_message_bytes: int,
        options: Sequence[tuple[str, Any]],
        grace_s: float,
        log_level: str,
        log_format: str,
    ) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="loadmaster-grpc-"))  # 0700: only we connect
        self.upstream = f"unix:{self._folder / 'gateway.sock'}"
        self._listen = listen
        self._config = RelayConfig(
            listen=listen,
            upstream=self.upstream,
            methods=methods,
            handoff_methods=list(handoff_methods),
            large_message_bytes=large_message_bytes,
            options=list(options),
            grace_s=grace_s,
            log_level=log_level,
            log_format=log_format,
        )
        self._process: asyncio.subprocess.Process | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._stopping = False
        self.port: int | None = None

    async def start(self) -> None:
        internal_auth.check_listen("gateway", self._listen)
        await self._sweep()
        self.port = await self._spawn()
        # Started again, it binds the port it has now (the configured one may be ":0").
        host, _, _ = self._listen.rpartition(":")
        self._config = _replace(self._config, listen=f"{host}:{self.port}")
        self._watcher = asyncio.create_task(self._watch(), name="grpc-relay-watch")

    async def _spawn(self) -> int:
        tls = transport.current()
        config = _replace(self._config, tls_cert=tls.tls_cert.decode(), tls_key=tls.tls_key.decode())
        # KILL, not TERM, if the gateway dies: the relay ignores TERM (it stops when told).
        process = await asyncio.create_subprocess_exec(
            *die_with_parent([sys.executable, "-m", __name__], signal_name="KILL"),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdin is not None and process.stdout is not None
        self._process = process
        process.stdin.write(json.dumps(asdict(config)).encode() + b"\n")
        await process.stdin.drain()
        try:
            line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
            port = int(json.loads(line)["port"])
        except (TimeoutError, ValueError, KeyError) as error:
            process.kill()
            await process.wait()
            raise RuntimeError(
                f"the gRPC front-end process did not start on {self._listen} ({error!r}; its log says why)"
            ) from None
        log.info("gRPC front-end process %d serves %s (port %d)", process.pid, self._listen, port)
        return port

    async def _watch(self) -> None:
        while not self._stopping:
            assert self._process is not None
            try:
                code = await asyncio.wait_for(self._process.wait(), SWEEP_INTERVAL_S)
            except TimeoutError:
                await self._sweep()
                continue
            if self._stopping:
                return
            log.error("the gRPC front-end process exited (code %s): starting it again", code)
            if self._process.stdin is not None:
                self._process.stdin.close()
            await asyncio.sleep(RESTART_DELAY_S)
            try:
                await self._spawn()
            except Exception:
                log.exception("starting the gRPC front-end process failed")

    async def _sweep(self) -> None:
        try:
            removed = await asyncio.to_thread(grpc_handoff.sweep)
        except Exception:
            log.exception("removing stale shared-memory messages failed")
            return
        if removed:
            log.info("removed %d shared-memory message(s) nobody read: %s", len(removed), removed[:5])

    async def stop(self) -> None:
        self._stopping = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        process = self._process
        if process is not None and process.returncode is None:
            assert process.stdin is not None
            process.stdin.close()  # the child stops: nothing is in flight any more
            try:
                await asyncio.wait_for(process.wait(), self._config.grace_s + STOP_SLACK_S)
            except TimeoutError:
                log.warning("the gRPC front-end process did not stop in time: killing it")
                process.kill()
                await process.wait()
        shutil.rmtree(self._folder, ignore_errors=True)


def _replace(config: RelayConfig, **changes: Any) -> RelayConfig:
    return RelayConfig(**{**asdict(config), **changes})


# -- the child -------------------------------------------------------------------------------


async def serve(config: RelayConfig, *, stopped: Callable[[], Awaitable[object]]) -> None:
    """Serve `config.listen` until `stopped()` returns, then stop within the grace."""
    channel = grpc.aio.insecure_channel(config.upstream, options=_CHANNEL_OPTIONS)
    server = grpc.aio.server(options=[tuple(option) for option in config.options])
    server.add_generic_rpc_handlers((RelayHandler(channel, config),))
    if config.tls_cert:
        credentials = grpc.ssl_server_credentials([(config.tls_key.encode(), config.tls_cert.encode())])
        port = server.add_secure_port(config.listen, credentials)
    else:
        port = server.add_insecure_port(config.listen)
    if port == 0:
        raise RuntimeError(f"gRPC front end: could not bind {config.listen}")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    try:
        await stopped()
    finally:
        await server.stop(config.grace_s)
        await channel.close()


def main() -> None:
    from loadmaster.common.logging import setup_logging

    for sig in (signal.SIGINT, signal.SIGTERM):  # the gateway says when: it closes our stdin
        signal.signal(sig, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    if not line:
        return
    config = RelayConfig(**json.loads(line))
    setup_logging("gateway-grpc", config.log_level, "json" if config.log_format == "json" else "logfmt")

    async def stdin_closed() -> None:
        await asyncio.to_thread(sys.stdin.buffer.read)

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve(config, stopped=stdin_closed))


if __name__ == "__main__":
    main()
