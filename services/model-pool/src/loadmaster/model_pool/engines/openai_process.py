"""OpenAI-process engine: a model served by an external OpenAI-compatible server process
(llama-server, vLLM, SGLang, `transformers serve`) that this worker starts and stops.

`backend: openai_process` in a model's config.yaml (docs/engine-processes.md):

    command: transformers serve {model_path} --host {host} --port {port} --device cpu
    path: ../tiny-chat/artifacts     # {model_path}, relative to the model folder
    vram_mb: 2000                    # the lease (default: weight files x 1.3)

    load()     (instance thread) a free port on `host`; the command with CUDA_VISIBLE_DEVICES
               = the lease's GPUs (one, or all of a split lease); output to the worker's log
               prefixed `[engine <model>]`; /health (`health_path`) polled up to
               `load_timeout_s`; the served model's name read from /v1/models
    warmup()   one 1-token generation, so the first request does not pay for the engine's own
    submit()   (event loop) forwards the request with an async HTTP client, always streaming;
               the SSE chunks become TokenChunks on the data plane, then one GenerationEnd
    unload()   (instance thread) open streams end with an error; SIGTERM to the process group,
               SIGKILL after `stop_grace_s`; returns once every process of the group is gone
               and, on NVIDIA, NVML lists none of them on the lease's GPUs, so the pool
               releases the lease only then

If the engine exits by itself, its open streams end with an error naming the exit status and
`context.on_failure` tells the pool, which unloads the model (slot IDLE, error = the status)
and delays the next load after repeated crashes (`crash_backoff.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadmaster.common.errors import InvalidArgumentError, UnavailableError
from loadmaster.common.ports import free_port
from loadmaster.model_pool.engines._proxy_streams import (
    ProxyGeneration,
    ProxyStream,
    openai_response_format,
    request_body,
)
from loadmaster.model_pool.engines.base import Engine, EngineContext
from loadmaster.model_pool.engines.engine_process import (
    EngineExitedError,
    EngineProcess,
    engine_env,
    gpus_of,
    render_command,
)
from loadmaster.model_pool.generation import FinishReason, GenerationRequest, GenerationStats
from loadmaster.model_pool.memory import wait_processes_gone
from loadmaster.model_pool.repository import ModelConfigError, ModelSpec, OpenAIProcessModelConfig

__all__ = ["OpenAIProcessEngine"]

log = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
_NVML_WAIT_S = 10.0
_CLOSE_TIMEOUT_S = 5.0


def _config(spec: ModelSpec) -> OpenAIProcessModelConfig:
    assert isinstance(spec.config, OpenAIProcessModelConfig)
    return spec.config


def model_path(spec: ModelSpec) -> Path:
    """`path` from the model folder. It may lead outside the folder: only the engine reads it."""
    path = Path(_config(spec).path)
    return path if path.is_absolute() else (spec.folder / path).resolve()


def refuse_unproxied(request: GenerationRequest, model_id: str) -> None:
    """What the proxy does not carry to an engine process yet is a 400 naming it, never
    dropped: tools, log probabilities, n > 1 (docs/tool-calling.md)."""
    where = f"model '{model_id}' runs in an engine process, which Loadmaster does not pass"
    if request.tools is not None:
        raise InvalidArgumentError(f"tools: {where} tools to")
    if request.logprobs is not None:
        raise InvalidArgumentError(f"logprobs: {where} log probabilities from")
    if request.n > 1:
        raise InvalidArgumentError(f"n: {where} several choices to")


class OpenAIProcessEngine(Engine):
    backend = "openai_process"

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        super().__init__(spec, context)
        self._config = _config(spec)
        self._process: EngineProcess | None = None
        self._base_url = ""
        self._served = ""
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, ProxyStream] = {}
        self._exit_status: int | None = None

    # ---- memory ---------------------------------------------------------

    @classmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        path = model_path(spec)
        if path.is_file():
            return [path]
        weights = sorted(p for p in path.rglob("*") if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
        if not weights:
            raise ModelConfigError(
                f"model '{spec.model_id}': no weight files ({', '.join(_WEIGHT_SUFFIXES)}) in {path}; "
                "give vram_mb"
            )
        return weights

    # ---- lifecycle (on the instance's executor thread) -------------------

    def load(self) -> None:
        config = self._config
        port = free_port(config.host)
        gpus = gpus_of(self.context.device, self.context.gpus)
        argv = render_command(
            config.command,
            model_path=str(model_path(self.spec)),
            port=port,
            host=config.host,
            gpus=gpus or (),
        )
        process = EngineProcess(
            argv,
            env=engine_env(os.environ, gpus=gpus, extra=config.env),
            name=self.spec.model_id,
            on_exit=self._exited,
            cwd=str(self.spec.folder),
        )
        self._process = process
        self._base_url = f"http://{_url_host(config.host)}:{port}"
        process.start()
        try:
            process.wait_healthy(self._base_url + config.health_path, timeout_s=config.load_timeout_s)
            self._served = config.served_model or self._first_model()
        except EngineExitedError as error:
            raise UnavailableError(f"model '{self.spec.model_id}': {error}") from None
        except TimeoutError as error:
            raise UnavailableError(f"model '{self.spec.model_id}': {error}") from None
        log.info("[engine %s] healthy at %s, serving %r", self.spec.model_id, self._base_url, self._served)

    def warmup(self) -> None:
        if not self.spec.config.warmup:
            return
        body = {"model": self._served, "prompt": "hi", "max_tokens": 1, "temperature": 0.0}
        response = httpx.post(
            self._base_url + "/v1/completions", json=body, timeout=self._config.load_timeout_s
        )
        if response.status_code != 200:
            raise UnavailableError(
                f"model '{self.spec.model_id}': warm-up answered {response.status_code}: {response.text[:500]}"
            )

    def unload(self) -> None:
        for state in list(self._streams.values()):
            self._fail_threadsafe(state, "the model was unloaded")
        self._close_client()
        process, self._process = self._process, None
        if process is None:
            return
        pids = process.group_pids()
        status = process.stop(grace_s=self._config.stop_grace_s)
        log.info("[engine %s] stopped (status %s)", self.spec.model_id, status)
        gpus = gpus_of(self.context.device, self.context.gpus)
        if gpus and not wait_processes_gone(gpus, pids, timeout_s=_NVML_WAIT_S):
            log.warning(
                "[engine %s] NVML still lists its processes on GPUs %s after %.0fs",
                self.spec.model_id,
                list(gpus),
                _NVML_WAIT_S,
            )

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise InvalidArgumentError(
            f"model '{self.spec.model_id}' is generative (backend openai_process): send it a generation "
            "request, not tensors"
        )

    # ---- generation (on the event loop) ---------------------------------

    @property
    def healthy(self) -> bool:
        """False once the engine process has exited."""
        process = self._process
        return process is None or process.alive

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None else process.pid

    async def submit(self, request: GenerationRequest) -> ProxyGeneration:
        """Validate and forward one generation; its events follow on the returned stream."""
        request.check()
        process = self._process
        if process is None or not process.alive:
            raise UnavailableError(self._gone_message())
        if request.request_id in self._streams:
            raise InvalidArgumentError(f"request_id: {request.request_id!r} is already generating")
        refuse_unproxied(request, self.spec.model_id)
        self._loop = asyncio.get_running_loop()
        # Structured output (issue 22): the engine enforces `response_format` itself.
        response_format = openai_response_format(getattr(request, "response_format", None))
        path, body = request_body(request, model=self._served, response_format=response_format)
        state = ProxyStream(request.request_id, request.params.stop, self._forget)
        self._streams[request.request_id] = state
        state.task = asyncio.create_task(
            self._forward(state, path, body), name=f"engine-{request.request_id}"
        )
        return ProxyGeneration(state, self.cancel)

    def cancel(self, request_id: str) -> bool:
        """End a generation (CANCELLED) and drop its connection, which aborts it in the engine."""
        state = self._streams.get(request_id)
        if state is None:
            return False
        state.end(FinishReason.CANCELLED)
        if state.task is not None:
            state.task.cancel()
        return True

    def preempt(self, request_id: str) -> bool:
        return False  # an engine process schedules its own sequences

    def resume(self, request_id: str) -> bool:
        return False

    def stats(self) -> GenerationStats:
        return GenerationStats(
            running=len(self._streams),
            waiting=0,
            kv_blocks_used=0,
            kv_blocks_total=0,
            streams_open=len(self._streams),
        )

    # ---- helpers --------------------------------------------------------

    async def _forward(self, state: ProxyStream, path: str, body: dict[str, Any]) -> None:
        client = self._http()
        try:
            async with client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode("utf-8", errors="replace")[:1000]
                    state.end(FinishReason.ERROR, f"the engine answered {response.status_code}: {detail}")
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        state.end(
                            FinishReason.ERROR, f"the engine sent a chunk that is not JSON: {data[:200]!r}"
                        )
                        return
                    if state.feed(chunk):
                        return
            state.finished()
        except asyncio.CancelledError:
            state.end(FinishReason.CANCELLED)
            raise
        except httpx.HTTPError as error:
            await self._settle_exit()
            state.end(
                FinishReason.ERROR,
                self._gone_message() if not self.healthy else f"engine request failed: {error!r}",
            )

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            timeout = httpx.Timeout(connect=5.0, read=self._config.request_timeout_s, write=30.0, pool=30.0)
            limits = httpx.Limits(
                max_connections=self._config.max_sequences * 2, max_keepalive_connections=64
            )
            self._client = httpx.AsyncClient(base_url=self._base_url, timeout=timeout, limits=limits)
        return self._client

    async def _settle_exit(self) -> None:
        """A broken connection often comes just before the exit is seen: give it a moment."""
        process = self._process
        if process is not None:
            for _ in range(20):
                if process.returncode is not None:
                    return
                await asyncio.sleep(0.025)

    def _first_model(self) -> str:
        response = httpx.get(self._base_url + "/v1/models", timeout=10.0)
        try:
            return str(response.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise UnavailableError(
                f"model '{self.spec.model_id}': the engine's /v1/models lists no model "
                f"({response.status_code}: {response.text[:300]}); set served_model"
            ) from None

    def _gone_message(self) -> str:
        if self._exit_status is not None:
            return (
                f"the engine process of model '{self.spec.model_id}' exited with status {self._exit_status}"
            )
        process = self._process
        if process is not None and process.returncode is not None:
            return (
                f"the engine process of model '{self.spec.model_id}' exited with status {process.returncode}"
            )
        return f"model '{self.spec.model_id}' is not loaded"

    def _exited(self, status: int) -> None:
        """On the engine's output thread: it exited by itself. Fail its streams, tell the pool."""
        self._exit_status = status
        message = self._gone_message()
        for state in list(self._streams.values()):
            self._fail_threadsafe(state, message)
        if self.context.on_failure is not None:
            self.context.on_failure(f"engine process exited with status {status}")

    def _fail_threadsafe(self, state: ProxyStream, message: str) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._fail, state, message)
        except RuntimeError:
            pass  # the loop closed meanwhile: nobody is listening

    def _fail(self, state: ProxyStream, message: str) -> None:
        state.end(FinishReason.ERROR, message)
        if state.task is not None:
            state.task.cancel()

    def _forget(self, state: ProxyStream) -> None:
        key = state.request_id
        if self._streams.get(key) is state:
            del self._streams[key]

    def _close_client(self) -> None:
        client, self._client = self._client, None
        loop = self._loop
        if client is None or loop is None or loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(_CLOSE_TIMEOUT_S)
        except Exception as error:
            log.debug("closing the HTTP client of %s: %s", self.spec.model_id, error)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
