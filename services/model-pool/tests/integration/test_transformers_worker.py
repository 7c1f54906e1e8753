"""A real worker with `tiny-chat` (backend transformers) against the real gpu-broker: the
lease follows the model, tensors on the data port are refused, the engine generates while
loaded and its streams end when the model is unloaded."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from loadmaster.common.config import (
    CategoryKeepAliveSettings,
    GpuBrokerSettings,
    MetricsSettings,
    ModelPoolSettings,
    ModelsSettings,
    SchedulerSettings,
    Settings,
)
from loadmaster.model_pool.engines.transformers import TransformersEngine
from loadmaster.model_pool.generation import (
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    SamplingParams,
)
from loadmaster.model_pool.repository import ModelRepository
from loadmaster.model_pool.server import build
from loadmaster.model_pool.slots import ModelState
from loadmaster.v1 import errors_pb2, gpu_broker_pb2

if TYPE_CHECKING:
    from conftest import BrokerAt

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


@pytest.fixture(scope="module")
def chat_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chat") / "models"
    (root / "tiny-chat").mkdir(parents=True)
    shutil.copy(EXAMPLES / "models" / "tiny-chat" / "config.yaml", root / "tiny-chat" / "config.yaml")
    spec = importlib.util.spec_from_file_location("_lm_make_models_chat", EXAMPLES / "make_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build(["tiny-chat"], root=root)
    return root


async def test_worker_leases_serves_and_unloads_tiny_chat(
    real_broker: BrokerAt, chat_repo: Path, start_worker: Any, make_client: Any
) -> None:
    expected_mb = TransformersEngine.estimate_mb(ModelRepository(chat_repo).spec("tiny-chat"))
    async with (
        real_broker() as (address, stub),
        start_worker(chat_repo, preload=["tiny-chat"], broker_address=address) as worker,
    ):
        leases = (await stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(holder="worker-test"))).leases
        assert [(lease.labels["model"], dict(lease.mb_per_gpu)) for lease in leases] == [
            ("tiny-chat", {0: expected_mb})
        ]
        assert worker.pool.status("tiny-chat").backend == "transformers"

        client = make_client(worker.data_endpoint)
        reply, _ = await client.call("tiny-chat", {"x": np.ones(2, np.float32)})
        assert reply.error_code == errors_pb2.ERROR_CODE_INVALID_ARGUMENT
        assert "generative" in reply.error_message

        engine = worker.pool._loaded["tiny-chat"].instances[0].engine
        assert isinstance(engine, TransformersEngine)
        request = GenerationRequest("w1", SamplingParams(max_tokens=4, temperature=0.0), prompt="hi")
        events = [event async for event in await engine.submit(request)]
        assert isinstance(events[-1], GenerationEnd) and events[-1].finish_reason is FinishReason.LENGTH

        open_stream = await engine.submit(
            GenerationRequest("w2", SamplingParams(max_tokens=2000), prompt="hi")
        )
        await worker.pool.unload("tiny-chat")
        events = [event async for event in open_stream]
        assert events[-1].finish_reason is FinishReason.ERROR and "unloaded" in events[-1].error
        leases = (await stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(holder="worker-test"))).leases
        assert list(leases) == []


async def test_an_idle_tiny_chat_is_unloaded_after_the_llm_keep_alive(
    real_broker: BrokerAt, chat_repo: Path, scheduler: tuple[Any, str]
) -> None:
    """tiny-chat names no keep-alive: its category (llm, from backend transformers) gives it one,
    here 1 s instead of the default 300 s; once idle that long, its engine and lease are gone."""
    async with real_broker() as (address, stub):
        settings = Settings(
            model_pool=ModelPoolSettings(
                address="127.0.0.1:0",
                data_bind="tcp://127.0.0.1:*",
                worker_id="worker-test",
                preload=["tiny-chat"],
                inference_threads=1,
            ),
            scheduler=SchedulerSettings(address=scheduler[1]),
            gpu_broker=GpuBrokerSettings(address=address),
            metrics=MetricsSettings(enabled=False),
            models=ModelsSettings(
                repository=chat_repo, category_keep_alive_s=CategoryKeepAliveSettings(llm=1.0)
            ),
        )
        worker = await build(settings)
        await worker.start()
        try:
            assert worker.pool.status("tiny-chat").state is ModelState.READY
            for _ in range(100):  # bounded: 100 x 0.1 s
                if worker.pool.status("tiny-chat").state is ModelState.IDLE:
                    break
                await asyncio.sleep(0.1)
            status = worker.pool.status("tiny-chat")
            assert status.state is ModelState.IDLE and "evicted (idle)" in status.error
            leases = (await stub.ListLeases(gpu_broker_pb2.ListLeasesRequest(holder="worker-test"))).leases
            assert list(leases) == []
        finally:
            await worker.stop()
