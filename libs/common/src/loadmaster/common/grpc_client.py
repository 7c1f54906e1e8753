"""gRPC client helpers: channels with the suite's options, and waiting on health."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadmaster.common import internal_auth, tracing, transport
from loadmaster.common.grpc_server import GRPC_OPTIONS
from loadmaster.common.retry import Backoff

__all__ = [
    "CLIENT_OPTIONS",
    "FRESH_CONNECT_OPTIONS",
    "aio_channel",
    "check_health",
    "wait_for_health",
    "wait_for_health_sync",
]


# Internal peers restart (deploys, crashes): reconnect within a second or two of their return
# instead of gRPC's default backoff of up to 120 s, which would outlast leases and sessions.
CLIENT_OPTIONS: list[tuple[str, Any]] = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


# For a channel made afresh at each reconnect (the scheduler sessions): its own subchannels,
# so it tries every address of its target at once instead of inheriting the reconnect backoff
# (up to max_reconnect_backoff_ms) of the process-wide subchannel an earlier channel left.
FRESH_CONNECT_OPTIONS: list[tuple[str, Any]] = [("grpc.use_local_subchannel_pool", 1)]


def aio_channel(address: str, *, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """A channel with the suite's options (`options` override them); traced when tracing is on
    (`loadmaster.common.tracing`); its calls carry this process's internal credential when it
    has one (`internal_auth`); TLS when the process has a CA for it (`transport`)."""
    interceptors = [*tracing.client_interceptors(), *internal_auth.client_interceptors()]
    # `options` win: gRPC core takes the first of two equal keys, so they are merged here.
    merged = list({**dict(CLIENT_OPTIONS), **dict(options or [])}.items())
    tls = transport.channel_credentials()
    if tls is not None:
        return grpc.aio.secure_channel(address, tls, options=merged, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=merged, interceptors=interceptors)


async def check_health(channel: grpc.aio.Channel, service: str = "", timeout_s: float = 1.0) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def wait_for_health(address: str, *, timeout_s: float, service: str = "") -> None:
    """Return once `address` reports SERVING; raise TimeoutError at the deadline.

    Uses the health Watch stream, so a server that comes up is noticed at once
    rather than at the next poll; a refused connection is retried with backoff.
    """
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(first_s=0.02, max_s=0.25)
    async with aio_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{address} not SERVING after {timeout_s:.1f}s")
            try:
                call = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=remaining)
                async for reply in call:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        call.cancel()
                        return
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue
            await asyncio.sleep(min(backoff.next_s(), max(0.0, deadline - time.monotonic())))


def wait_for_health_sync(address: str, *, timeout_s: float, service: str = "") -> None:
    """`wait_for_health` for synchronous callers, on the blocking gRPC API: no event loop of its
    own, so callers that later run grpc.aio in a loop of theirs are not left with a closed one."""
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(first_s=0.02, max_s=0.25)
    tls = transport.channel_credentials()
    with (
        grpc.insecure_channel(address, options=CLIENT_OPTIONS)
        if tls is None
        else grpc.secure_channel(address, tls, options=CLIENT_OPTIONS)
    ) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{address} not SERVING after {timeout_s:.1f}s")
            call = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=remaining)
            try:
                for reply in call:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError:
                pass  # refused or deadline: retry until ours
            finally:
                call.cancel()
            time.sleep(min(backoff.next_s(), max(0.0, deadline - time.monotonic())))
