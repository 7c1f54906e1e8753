"""`loadmaster models list | load | unload | pin` against a real worker over gRPC, and the Pin RPC."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from rich.console import Console
from typer.testing import CliRunner

from loadmaster.cli import models_cmd
from loadmaster.cli.models_cmd import app
from loadmaster.model_pool.server import ModelPoolServer
from loadmaster.v1 import model_pool_pb2, model_pool_pb2_grpc

runner = CliRunner()


async def cli(*args: str) -> tuple[int, str]:
    result = await asyncio.to_thread(runner.invoke, app, list(args), catch_exceptions=False)
    return result.exit_code, result.output


async def test_models_admin_commands(worker: ModelPoolServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models_cmd, "console", Console(width=250))
    address = f"127.0.0.1:{worker.port}"
    code, out = await cli("load", "double", "--worker", address)
    assert code == 0, out
    assert "double" in out and "READY" in out
    code, out = await cli("pin", "double", "--worker", address)
    assert code == 0 and "pinned" in out
    assert worker.pool.status("double").pinned
    code, out = await cli("list", "--worker", address)
    assert code == 0, out
    assert "double" in out and "READY" in out and "yes" in out and "policy-onnx" in out
    code, out = await cli("pin", "double", "--off", "--worker", address)
    assert code == 0 and not worker.pool.status("double").pinned
    code, out = await cli("unload", "double", "--worker", address)
    assert code == 0 and "IDLE" in out
    code, out = await cli("load", "no-such-model", "--worker", address)
    assert code == 1 and "no-such-model" in out


async def test_pin_rpc_reports_to_the_scheduler(worker: ModelPoolServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        stub = model_pool_pb2_grpc.ModelPoolServiceStub(channel)
        reply = await stub.Pin(model_pool_pb2.PinRequest(model_id="sleep", pinned=True))
        assert reply.model.pinned and reply.model.model_id == "sleep"
        status = await stub.Status(model_pool_pb2.StatusRequest())
        assert {m.model_id: m.pinned for m in status.models}["sleep"] is True
        try:
            await stub.Pin(model_pool_pb2.PinRequest(model_id="nope", pinned=True))
        except grpc.aio.AioRpcError as error:
            assert error.code() is grpc.StatusCode.NOT_FOUND
        else:
            raise AssertionError("pinning an unknown model must fail")
