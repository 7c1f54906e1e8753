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
               (`_openai_proxy.py`, shared with the hosted-API backend remote_openai)
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
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import httpx
import numpy as np

from loadmaster.common.errors import InvalidArgumentError, UnavailableError
from loadmaster.common.ports import free_port
from loadmaster.model_pool.engines._openai_proxy import OpenAIProxyEngine
from loadmaster.model_pool.engines.base import EngineContext
from loadmaster.model_pool.engines.engine_process import (
    EngineExitedError,
    EngineProcess,
    engine_env,
    gpus_of,
    render_command,
)
from loadmaster.model_pool.memory import wait_processes_gone
from loadmaster.model_pool.repository import ModelConfigError, ModelSpec, OpenAIProcessModelConfig

__all__ = ["OpenAIProcessEngine"]

log = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
_NVML_WAIT_S = 10.0


def _config(spec: ModelSpec) -> OpenAIProcessModelConfig:
    assert isinstance(spec.config, OpenAIProcessModelConfig)
    return spec.config


def model_path(spec: ModelSpec) -> Path:
    """`path` from the model folder. It may lead outside the folder: only the engine reads it."""
    path = Path(_config(spec).path)
    return path if path.is_absolute() else (spec.folder / path).resolve()


class OpenAIProcessEngine(OpenAIProxyEngine):
    backend = "openai_process"

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        config = _config(spec)
        super().__init__(
            spec,
            context,
            max_sequences=config.max_sequences,
            request_timeout_s=config.request_timeout_s,
            forward_priority=config.forward_priority,
        )
        self._config = config
        self._process: EngineProcess | None = None
        self._base_url = ""
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
        self._api_url = self._base_url + "/v1"
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
        self.fail_all("the model was unloaded")
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

    # ---- the process ------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """False once the engine process has exited."""
        process = self._process
        return process is None or process.alive

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None else process.pid

    def _serving(self) -> bool:
        process = self._process
        return process is not None and process.alive and bool(self._api_url)

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
        self.fail_all(self._gone_message())
        if self.context.on_failure is not None:
            self.context.on_failure(f"engine process exited with status {status}")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
