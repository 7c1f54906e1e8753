"""GrpcServer over a real in-process server on 127.0.0.1:0: error mapping, health, reflection, hooks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from loadmaster.common import errors
from loadmaster.common.errors import LoadmasterError, NotFoundError
from loadmaster.common.grpc_server import GrpcServer
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc

METRICS_SERVICE = "loadmaster.v1.MetricsService"
HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
REFLECTION_V1_SERVICE = "grpc.reflection.v1.ServerReflection"


def all_subclasses(cls: type[LoadmasterError]) -> list[type[LoadmasterError]]:
    found: list[type[LoadmasterError]] = []
    for sub in cls.__subclasses__():
        found += [sub, *all_subclasses(sub)]
    return found


# Only the common library's own kinds: services may subclass them (imported in the same run).
ERRORS = {
    cls.__name__: cls
    for cls in all_subclasses(LoadmasterError)
    if cls.__module__ == LoadmasterError.__module__
}


def raise_named(name: str) -> None:
    """Raise the LoadmasterError subclass `name`, or a plain exception for anything else."""
    if name in ERRORS:
        raise ERRORS[name](f"{name} raised on purpose")
    if name == "KeyError":
        raise KeyError("secret-internal-detail")
    if name == "AttributeError":
        raise AttributeError("'NoneType' object has no attribute 'slots'")


def _watched(name: str) -> metrics_pb2.MetricsServiceWatchResponse:
    return metrics_pb2.MetricsServiceWatchResponse(samples=[metrics_pb2.Sample(name=name)])


class RaisingMetrics(metrics_pb2_grpc.MetricsServiceServicer):
    """Each RPC raises what the request names: unary, server-streaming (async generator), client-streaming."""

    async def GetStats(  # noqa: N802 - gRPC method names
        self, request: metrics_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> metrics_pb2.GetStatsResponse:
        raise_named(request.name)
        return metrics_pb2.GetStatsResponse(stats=metrics_pb2.Stats(count=1))

    async def Watch(  # noqa: N802 - gRPC method names
        self, request: metrics_pb2.MetricsServiceWatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[metrics_pb2.MetricsServiceWatchResponse]:
        yield _watched("first")
        raise_named(request.names[0])
        yield _watched("second")

    async def Report(  # noqa: N802 - gRPC method names
        self, request_iterator: AsyncIterator[metrics_pb2.ReportRequest], context: grpc.aio.ServicerContext
    ) -> metrics_pb2.ReportResponse:
        async for batch in request_iterator:
            raise_named(batch.service)
        return metrics_pb2.ReportResponse(accepted=1)


class WritingMetrics(metrics_pb2_grpc.MetricsServiceServicer):
    """A server-streaming handler written as a coroutine that calls context.write."""

    async def Watch(  # noqa: N802 - gRPC method names
        self, request: metrics_pb2.MetricsServiceWatchRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await context.write(_watched("first"))
        raise NotFoundError("no such series")


@pytest.fixture()
async def server() -> AsyncIterator[GrpcServer]:
    srv = GrpcServer("test", "127.0.0.1:0", grace_s=0.5)
    srv.add_service(METRICS_SERVICE, metrics_pb2_grpc.add_MetricsServiceServicer_to_server, RaisingMetrics())
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


@pytest.fixture()
async def channel(server: GrpcServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


async def health_of(port: int, service: str = "") -> int | grpc.StatusCode:
    """The health status of `service`, or the status code of the failed Check."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
        except grpc.aio.AioRpcError as error:
            return error.code()
        return reply.status


# --- error mapping --------------------------------------------------------------------------


async def test_unary_maps_every_loadmaster_error_to_its_status(channel: grpc.aio.Channel) -> None:
    stub = metrics_pb2_grpc.MetricsServiceStub(channel)
    assert len(ERRORS) == 12
    for name, cls in ERRORS.items():
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetStats(metrics_pb2.GetStatsRequest(name=name), timeout=5)
        assert caught.value.code() == cls.grpc_code, name
        assert caught.value.details() == f"{name} raised on purpose"
        assert errors.from_grpc_error(caught.value).grpc_code == cls.grpc_code
    reply = await stub.GetStats(metrics_pb2.GetStatsRequest(name="ok"), timeout=5)
    assert reply.stats.count == 1  # successful calls pass through untouched


async def test_server_streaming_maps_every_loadmaster_error_after_items_were_sent(
    channel: grpc.aio.Channel,
) -> None:
    stub = metrics_pb2_grpc.MetricsServiceStub(channel)
    for name, cls in ERRORS.items():
        received: list[str] = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for sample in stub.Watch(metrics_pb2.MetricsServiceWatchRequest(names=[name]), timeout=5):
                received.append(sample.samples[0].name)
        assert received == ["first"], name
        assert caught.value.code() == cls.grpc_code, name
        assert caught.value.details() == f"{name} raised on purpose"
    items = [
        s.samples[0].name
        async for s in stub.Watch(metrics_pb2.MetricsServiceWatchRequest(names=["ok"]), timeout=5)
    ]
    assert items == ["first", "second"]


async def test_client_streaming_maps_loadmaster_errors(channel: grpc.aio.Channel) -> None:
    stub = metrics_pb2_grpc.MetricsServiceStub(channel)
    for name, cls in ERRORS.items():
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Report(iter([metrics_pb2.ReportRequest(service=name)]), timeout=5)
        assert caught.value.code() == cls.grpc_code, name


@pytest.mark.parametrize("exception", ["KeyError", "AttributeError"])
async def test_unknown_exceptions_become_internal_without_leaking_details(
    channel: grpc.aio.Channel, exception: str, caplog: pytest.LogCaptureFixture
) -> None:
    stub = metrics_pb2_grpc.MetricsServiceStub(channel)
    caplog.set_level(logging.ERROR, logger="loadmaster.common.grpc_server")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetStats(metrics_pb2.GetStatsRequest(name=exception), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert caught.value.details() == f"internal error: {exception}"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Watch(metrics_pb2.MetricsServiceWatchRequest(names=[exception]), timeout=5):
            pass
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "secret-internal-detail" not in (caught.value.details() or "")
    logged = [r for r in caplog.records if r.exc_info and "GetStats" in r.getMessage()]
    assert logged, "the traceback of an unknown exception is logged"


async def test_coroutine_streaming_handlers_map_loadmaster_errors() -> None:
    srv = GrpcServer("writer", "127.0.0.1:0", grace_s=0.1)
    srv.add_service(METRICS_SERVICE, metrics_pb2_grpc.add_MetricsServiceServicer_to_server, WritingMetrics())
    port = await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = metrics_pb2_grpc.MetricsServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Watch(metrics_pb2.MetricsServiceWatchRequest(), timeout=5):
                    pass
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await srv.stop()


# --- health, reflection, hooks --------------------------------------------------------------


async def test_health_is_serving_after_start_for_the_server_and_each_service(server: GrpcServer) -> None:
    assert server.port
    for service in ("", METRICS_SERVICE, HEALTH_SERVICE):
        assert await health_of(server.port, service) == health_pb2.HealthCheckResponse.SERVING
    assert await health_of(server.port, "no.such.Service") == grpc.StatusCode.NOT_FOUND


async def test_health_turns_not_serving_when_stop_begins() -> None:
    srv = GrpcServer("stopper", "127.0.0.1:0", grace_s=0.1)
    srv.add_service(METRICS_SERVICE, metrics_pb2_grpc.add_MetricsServiceServicer_to_server, RaisingMetrics())
    port = await srv.start()
    during_stop: dict[str, int | grpc.StatusCode] = {}

    async def probe(grace_left_s: float) -> None:  # drain hooks run while the server still answers
        for service in ("", METRICS_SERVICE):
            during_stop[service] = await health_of(port, service)

    srv.on_drain(probe)
    await srv.stop()
    assert during_stop == {
        "": health_pb2.HealthCheckResponse.NOT_SERVING,
        METRICS_SERVICE: health_pb2.HealthCheckResponse.NOT_SERVING,
    }
    assert await health_of(port) == grpc.StatusCode.UNAVAILABLE  # and then the port closes


async def test_reflection_lists_every_service(channel: grpc.aio.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    replies = [reply async for reply in call]
    names = {s.name for s in replies[0].list_services_response.service}
    assert names == {METRICS_SERVICE, HEALTH_SERVICE, REFLECTION_SERVICE, REFLECTION_V1_SERVICE}


async def test_reflection_v1_answers_as_v1alpha_does(channel: grpc.aio.Channel) -> None:
    """A client of the v1 protocol (its messages are v1alpha's on the wire) lists the services
    and gets the file that declares one, as grpcurl and grpc-js reflection ask."""
    call = channel.stream_stream(
        f"/{REFLECTION_V1_SERVICE}/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )(
        iter(
            [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=METRICS_SERVICE),
            ]
        ),
        timeout=5,
    )
    listing, file = [reply async for reply in call]
    assert METRICS_SERVICE in {s.name for s in listing.list_services_response.service}
    [proto] = file.file_descriptor_response.file_descriptor_proto
    assert descriptor_pb2.FileDescriptorProto.FromString(proto).package == "loadmaster.v1"


async def test_start_hooks_run_in_order_after_bind_and_stop_hooks_in_reverse() -> None:
    srv = GrpcServer("hooks", "127.0.0.1:0", grace_s=0.1)
    events: list[str] = []

    def hook(name: str) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            events.append(name)
            if name == "start-1":
                assert srv.port, "start hooks run after the port is bound"

        return run

    async def failing() -> None:
        events.append("stop-failing")
        raise RuntimeError("a broken stop hook must not block the others")

    srv.on_start(hook("start-1"))
    srv.on_start(hook("start-2"))
    srv.on_stop(hook("stop-1"))
    srv.on_stop(failing)
    srv.on_stop(hook("stop-3"))
    await srv.start()
    assert events == ["start-1", "start-2"]
    await srv.stop()
    assert events == ["start-1", "start-2", "stop-3", "stop-failing", "stop-1"]


async def test_a_slow_stop_hook_is_named_and_the_stop_says_when_it_drained(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from loadmaster.common import grpc_server

    monkeypatch.setattr(grpc_server, "_SLOW_STOP_HOOK_S", 0.05)
    srv = GrpcServer("slow-stop", "127.0.0.1:0", grace_s=0.1)

    async def slow_close() -> None:
        await asyncio.sleep(0.1)

    async def quick_close() -> None:
        pass

    srv.on_stop(slow_close)
    srv.on_stop(quick_close)
    await srv.start()
    with caplog.at_level(logging.INFO, logger="loadmaster.common.grpc_server"):
        await srv.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("slow-stop drained (") for m in messages), messages
    slow = [m for m in messages if "took" in m]
    assert len(slow) == 1 and "slow_close" in slow[0], messages


async def test_health_is_not_serving_while_start_hooks_run() -> None:
    srv = GrpcServer("starting", "127.0.0.1:0", grace_s=0.1)
    seen: list[int | grpc.StatusCode] = []

    async def probe() -> None:
        assert srv.port
        seen.append(await health_of(srv.port))

    srv.on_start(probe)
    await srv.start()
    try:
        assert seen and seen[0] != health_pb2.HealthCheckResponse.SERVING
    finally:
        await srv.stop()


async def test_run_serves_until_request_stop() -> None:
    srv = GrpcServer("runner", "127.0.0.1:0", grace_s=0.1)
    started = asyncio.Event()
    stopped: list[str] = []

    async def on_start() -> None:
        started.set()

    async def on_stop() -> None:
        stopped.append("stop")

    srv.on_start(on_start)
    srv.on_stop(on_stop)
    task = asyncio.create_task(srv.run())
    await asyncio.wait_for(started.wait(), 5)
    for _ in range(100):  # health turns SERVING right after the start hooks
        if srv.port and await health_of(srv.port) == health_pb2.HealthCheckResponse.SERVING:
            break
        await asyncio.sleep(0.01)
    assert not task.done()
    srv.request_stop()
    await asyncio.wait_for(task, 5)
    assert stopped == ["stop"]


class SlowMetrics(metrics_pb2_grpc.MetricsServiceServicer):
    """GetStats answers once `release` is set; `entered` says a call is in the handler."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def GetStats(  # noqa: N802 - gRPC method names
        self, request: metrics_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> metrics_pb2.GetStatsResponse:
        self.entered.set()
        await self.release.wait()
        return metrics_pb2.GetStatsResponse(stats=metrics_pb2.Stats(count=7))


async def test_stop_drains_then_lets_calls_in_flight_finish_before_the_stop_hooks_close_links() -> None:
    """SIGTERM order: NOT_SERVING, drain hooks (given the grace left), server.stop(grace) for the
    calls in flight, and only then the stop hooks (on main they closed links first)."""
    servicer = SlowMetrics()
    srv = GrpcServer("drainer", "127.0.0.1:0", grace_s=10.0)
    srv.add_service(METRICS_SERVICE, metrics_pb2_grpc.add_MetricsServiceServicer_to_server, servicer)
    events: list[str] = []
    grace_seen: list[float] = []

    async def drain(grace_left_s: float) -> None:
        grace_seen.append(grace_left_s)
        events.append("drain")
        servicer.release.set()  # the service's own drain lets its work finish

    async def close_links() -> None:
        events.append("stop: call done" if call.done() else "stop: call still in flight")

    srv.on_drain(drain)
    srv.on_stop(close_links)
    port = await srv.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = asyncio.ensure_future(
            metrics_pb2_grpc.MetricsServiceStub(ch).GetStats(
                metrics_pb2.GetStatsRequest(name="x"), timeout=10
            )
        )
        await asyncio.wait_for(servicer.entered.wait(), 5)
        await asyncio.wait_for(srv.stop(), 10)
        reply = await call
    assert reply.stats.count == 7
    assert events == ["drain", "stop: call done"]
    assert 9.0 < grace_seen[0] <= 10.0


async def test_a_drain_hook_that_outlives_the_grace_is_cancelled_and_stop_goes_on() -> None:
    srv = GrpcServer("stuck", "127.0.0.1:0", grace_s=0.2)
    stopped: list[str] = []
    cancelled = asyncio.Event()

    async def never_done(grace_left_s: float) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def on_stop() -> None:
        stopped.append("stop")

    srv.on_drain(never_done)
    srv.on_stop(on_stop)
    await srv.start()
    await asyncio.wait_for(srv.stop(), 10)  # the grace (0.2 s) plus the 1 s slack, not forever
    assert cancelled.is_set() and stopped == ["stop"]


class _Request:
    """A request that can be watched for being freed (a weak reference to it dies)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


async def test_a_refused_request_is_freed_without_waiting_for_a_garbage_collection() -> None:
    import gc
    import weakref

    seen: list[weakref.ref[_Request]] = []

    async def refuse(request: _Request, context: grpc.aio.ServicerContext) -> bytes:
        seen.append(weakref.ref(request))
        raise errors.InvalidArgumentError("refused on purpose")

    handler = grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=_Request)
    srv = GrpcServer("release", "127.0.0.1:0", grace_s=0.1)
    srv.server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Release", {"Refuse": handler}),)
    )
    port = await srv.start()
    gc.disable()  # what is freed now is freed by reference counting alone
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await channel.unary_unary("/test.Release/Refuse")(b"x" * 1000, timeout=5)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for _ in range(50):  # the server may still be finishing the call
            if seen[0]() is None:
                break
            await asyncio.sleep(0.01)
        assert seen[0]() is None, "the refused request is kept alive until a garbage collection"
    finally:
        gc.enable()
        await srv.stop()
