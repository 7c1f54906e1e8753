"""gRPC server bootstrap shared by every service.

`GrpcServer` builds a grpc.aio server with the standard health-checking and
reflection services and the one error-mapping interceptor. `run()` starts it,
marks it SERVING and waits for SIGTERM/SIGINT. A stop then goes, within one grace
period (`grace_s`, the service's `shutdown_grace_s`):

1. health NOT_SERVING for every service name, at once (load balancers move away);
2. the drain hooks, in order of adding: each refuses new work, ends the service's
   long-lived streams (sessions, watches, report streams) and waits for in-flight
   work, given the seconds of grace left;
3. `server.stop(grace left)`: in-flight gRPC calls finish, later ones are refused;
4. the stop hooks, in reverse order of adding: close links (HTTP server, peer
   channels, Redis, telemetry) once nothing in flight needs them.

Once serving, `run()` collects garbage once and freezes what is left (`gc.freeze`): the
imports and preloaded models stay alive for the life of the process, and a full
collection that walks them again stalls every request — up to 318 ms in a model-pool
worker with torch loaded, measured under the head-of-line benchmark.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from loadmaster.common import internal_auth, tracing, transport
from loadmaster.common.errors import ERROR_CODE_TRAILER, InternalError, LoadmasterError
from loadmaster.common.liveness import DEFAULT_KEEPALIVE_OPTIONS
from loadmaster.common.reflection import enable_reflection

__all__ = ["GRPC_OPTIONS", "ErrorInterceptor", "GrpcServer"]

log = logging.getLogger(__name__)

# Servers and clients alike; the live links (sessions, leases) add LIVENESS.grpc_options().
GRPC_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
    *DEFAULT_KEEPALIVE_OPTIONS,
]


def _status_for(error: BaseException, method: str) -> tuple[grpc.StatusCode, str, int]:
    if isinstance(error, LoadmasterError):
        return error.grpc_code, error.message, error.code
    log.error("unhandled error in %s", method, exc_info=error)
    return InternalError.grpc_code, f"internal error: {type(error).__name__}", InternalError.code


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps `LoadmasterError` to its status code; anything else to INTERNAL, logged with traceback."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method

        async def abort(context: grpc.aio.ServicerContext, error: BaseException) -> None:
            status, message, code = _status_for(error, method)
            # gRPC keeps the abort's exception in a reference cycle until a garbage collection;
            # through `error`'s traceback that would keep the failed call's frames, and the
            # request in them (up to the message size limit), alive as long.
            error.__traceback__ = error.__context__ = error.__cause__ = None
            # Several error kinds share a gRPC status; the trailer says which one it was.
            await context.abort(status, message, trailing_metadata=((ERROR_CODE_TRAILER, str(code)),))

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await inner_uu(request, context)
                except (LoadmasterError, Exception) as error:
                    if isinstance(error, asyncio.CancelledError) or _is_abort(error):
                        raise
                    del request  # this frame outlives the call in the abort's traceback (above)
                    await abort(context, error)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            inner_su = handler.stream_unary

            async def stream_unary(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await inner_su(request_iterator, context)
                except Exception as error:
                    if _is_abort(error):
                        raise
                    await abort(context, error)

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream and not inspect.isasyncgenfunction(handler.unary_stream):
            inner_usc = handler.unary_stream  # a coroutine that calls context.write

            async def unary_stream_coroutine(request: Any, context: grpc.aio.ServicerContext) -> None:
                try:
                    await inner_usc(request, context)
                except Exception as error:
                    if _is_abort(error):
                        raise
                    await abort(context, error)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream_coroutine, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_stream and not inspect.isasyncgenfunction(handler.stream_stream):
            inner_ssc = handler.stream_stream

            async def stream_stream_coroutine(
                request_iterator: Any, context: grpc.aio.ServicerContext
            ) -> None:
                try:
                    await inner_ssc(request_iterator, context)
                except Exception as error:
                    if _is_abort(error):
                        raise
                    await abort(context, error)

            return grpc.stream_stream_rpc_method_handler(
                stream_stream_coroutine, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    async for item in inner_us(request, context):
                        yield item
                except Exception as error:
                    if _is_abort(error):
                        raise
                    await abort(context, error)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_stream:
            inner_ss = handler.stream_stream

            async def stream_stream(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    async for item in inner_ss(request_iterator, context):
                        yield item
                except Exception as error:
                    if _is_abort(error):
                        raise
                    await abort(context, error)

            return grpc.stream_stream_rpc_method_handler(
                stream_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler


_DRAIN_SLACK_S = 1.0
# A stop hook slower than this is named in a warning (a stop that hangs says where).
_SLOW_STOP_HOOK_S = 2.0


def _is_abort(error: BaseException) -> bool:
    # context.abort() raises this internally; it must pass through untouched.
    return type(error).__name__ == "AbortError"


class GrpcServer:
    """A grpc.aio server with health, reflection, error mapping and graceful stop."""

    def __init__(
        self,
        name: str,
        listen: str,
        *,
        grace_s: float = 5.0,
        interceptors: list[grpc.aio.ServerInterceptor] | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.name = name
        self._listen = listen
        self._grace_s = grace_s
        self.server = grpc.aio.server(
            # Tracing (when on) is outermost, so its spans see the status the error mapping sets;
            # internal auth (when configured) refuses uncredentialed calls before any handler runs.
            interceptors=[
                *tracing.server_interceptors(),
                *internal_auth.server_interceptors(),
                ErrorInterceptor(),
                *(interceptors or []),
            ],
            options=list({**dict(GRPC_OPTIONS), **dict(options)}.items()),  # `options` win
        )
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names: list[str] = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        self._start_hooks: list[Callable[[], Awaitable[None]]] = []
        self._drain_hooks: list[Callable[[float], Awaitable[None]]] = []
        self._stop_hooks: list[Callable[[], Awaitable[None]]] = []
        self._stopping = asyncio.Event()
        self.port: int | None = None

    def add_service(self, full_name: str, add_to_server: Callable[[Any, Any], None], servicer: Any) -> None:
        add_to_server(servicer, self.server)
        self._service_names.append(full_name)

    def on_start(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run `hook` after the gRPC port is bound and before health turns SERVING (order of adding)."""
        self._start_hooks.append(hook)

    def on_drain(self, hook: Callable[[float], Awaitable[None]]) -> None:
        """Run `hook(grace_left_s)` once the server is NOT_SERVING, before the gRPC server stops
        (order of adding): refuse new work, end long-lived streams, wait (at most `grace_left_s`)
        for work in flight. A hook still running when the grace is spent is cancelled."""
        self._drain_hooks.append(hook)

    def on_stop(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run `hook` after the gRPC server stopped (in-flight calls done or the grace spent),
        in reverse order of adding: close the links the service's work needed."""
        self._stop_hooks.append(hook)

    @property
    def grace_s(self) -> float:
        return self._grace_s

    async def start(self) -> int:
        enable_reflection(self._service_names, self.server)
        # Probes must not see SERVING (grpc_health's default for "") before the hooks have run.
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        internal_auth.check_listen(self.name, self._listen)
        # A unix socket is reached only through its file's permissions: it takes no TLS.
        tls = None if self._listen.startswith("unix:") else transport.server_credentials()
        self.port = (
            self.server.add_insecure_port(self._listen)
            if tls is None
            else self.server.add_secure_port(self._listen, tls)
        )
        if self.port == 0:
            raise RuntimeError(f"{self.name}: could not bind {self._listen}")
        await self.server.start()
        for hook in self._start_hooks:
            await hook()
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)
        log.info("%s serving gRPC on %s (port %d)", self.name, self._listen, self.port)
        return self.port

    async def _set_all(self, status: int) -> None:
        for service in ["", *self._service_names]:
            result = self.health.set(service, status)
            if asyncio.iscoroutine(result):
                await result

    def request_stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT or `request_stop()`, then drain and stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._stopping.set)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        await self.start()
        _freeze_startup_heap(self.name)
        await self._stopping.wait()
        await self.stop()

    async def stop(self) -> None:
        started = time.monotonic()
        deadline = started + self._grace_s
        log.info("%s draining (grace %.1fs)", self.name, self._grace_s)
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        for drain in self._drain_hooks:
            left = max(0.0, deadline - time.monotonic())
            try:
                # A little past the grace: a hook that bounds itself by `left` ends on its own.
                await asyncio.wait_for(drain(left), left + _DRAIN_SLACK_S)
            except TimeoutError:
                log.warning("%s: a drain hook was still running when the grace ran out", self.name)
            except Exception:
                log.exception("%s: drain hook failed", self.name)
        await self.server.stop(max(0.0, deadline - time.monotonic()))
        log.info("%s drained (%.2fs); closing its links", self.name, time.monotonic() - started)
        for hook in reversed(self._stop_hooks):
            hook_started = time.monotonic()
            try:
                await hook()
            except Exception:
                log.exception("%s: stop hook failed", self.name)
            if (took := time.monotonic() - hook_started) > _SLOW_STOP_HOOK_S:
                log.warning(
                    "%s: stop hook %s took %.1fs", self.name, getattr(hook, "__qualname__", hook), took
                )
        log.info("%s stopped (%.2fs)", self.name, time.monotonic() - started)


def _freeze_startup_heap(name: str) -> None:
    """Collect once, then move every object alive now out of the collector's reach."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.debug(
        "%s: %d start-up objects frozen out of garbage collection (%.0f ms)",
        name,
        gc.get_freeze_count(),
        (time.perf_counter() - started) * 1000,
    )
