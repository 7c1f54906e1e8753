"""Remote engine: a model served by a hosted OpenAI-compatible API (docs/remote-models.md).

`backend: remote_openai` in a model's config.yaml:

    base_url: https://api.example.com/v1     # the API root, as the OpenAI SDK takes it
    remote_model: some-model-name             # what the API is asked for
    api_key_file: /run/secrets/example.key    # the key, read at each load (optional)

It is the engine-process proxy (`_openai_proxy.py`) without the process: the worker forwards
each generation to the API, always streaming, and turns its SSE into the data plane's chunks,
so the gateway's auth, priorities, queueing, metrics and audit apply as to a local model. It
holds no GPU memory, so the pool takes no lease for it (`leases_memory` False) and it never
makes room for, or is evicted to make room for, another model.

    load()     (instance thread) reads the key; with `check_on_load`, GET <base_url>/models
               must answer 200 (a wrong URL or key fails the load, so the model never turns
               READY and no ladder falls back to it)
    warmup()   nothing: a hosted API bills every token
    unload()   open streams end with an error; the HTTP client closes

The key travels only in the Authorization header to `base_url`; it is never logged, and an
error message from the API is passed on as the API wrote it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import httpx
import numpy as np

from loadmaster.common.errors import InvalidArgumentError, UnavailableError
from loadmaster.model_pool.engines._openai_proxy import OpenAIProxyEngine
from loadmaster.model_pool.engines.base import EngineContext
from loadmaster.model_pool.repository import ModelConfigError, ModelSpec, RemoteOpenAIModelConfig

__all__ = ["RemoteOpenAIEngine", "read_api_key"]

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 4096


def _config(spec: ModelSpec) -> RemoteOpenAIModelConfig:
    assert isinstance(spec.config, RemoteOpenAIModelConfig)
    return spec.config


def read_api_key(spec: ModelSpec) -> str | None:
    """The key in `api_key_file` (from the model folder, or absolute), stripped; None without one."""
    name = _config(spec).api_key_file
    if name is None:
        return None
    path = Path(name) if Path(name).is_absolute() else spec.folder / name
    try:
        raw = path.read_bytes()[: MAX_KEY_BYTES + 1]
    except OSError as error:
        raise ModelConfigError(
            f"model '{spec.model_id}': api_key_file {path}: {error.strerror or error}"
        ) from None
    key = raw.decode("utf-8", errors="replace").strip()
    if not key or len(raw) > MAX_KEY_BYTES or any(ch.isspace() for ch in key):
        raise ModelConfigError(
            f"model '{spec.model_id}': api_key_file {path} must hold one key (no spaces, at most "
            f"{MAX_KEY_BYTES} bytes)"
        )
    return key


class RemoteOpenAIEngine(OpenAIProxyEngine):
    backend = "remote_openai"
    leases_memory = False

    def __init__(self, spec: ModelSpec, context: EngineContext) -> None:
        config = _config(spec)
        super().__init__(
            spec, context, max_sequences=config.max_sequences, request_timeout_s=config.request_timeout_s
        )
        self._config = config

    @classmethod
    def artifact_files(cls, spec: ModelSpec) -> Iterable[Path]:
        return ()

    @classmethod
    def estimate_mb(cls, spec: ModelSpec) -> int:
        return 0

    # ---- lifecycle (on the instance's executor thread) -------------------

    def load(self) -> None:
        config = self._config
        key = read_api_key(self.spec)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if config.check_on_load:
            self._check(config.base_url, headers)
        self._headers = headers
        self._served = config.remote_model
        self._api_url = config.base_url
        log.info("[remote %s] %s at %s", self.spec.model_id, config.remote_model, config.base_url)

    def warmup(self) -> None:
        """Nothing: a warm-up generation would be billed, and there is nothing to warm here."""

    def unload(self) -> None:
        self.fail_all("the model was unloaded")
        self._close_client()
        self._api_url = ""

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise InvalidArgumentError(
            f"model '{self.spec.model_id}' is generative (backend remote_openai): send it a generation "
            "request, not tensors"
        )

    # ---- helpers --------------------------------------------------------

    def _check(self, base_url: str, headers: dict[str, str]) -> None:
        try:
            response = httpx.get(base_url + "/models", headers=headers, timeout=self._config.check_timeout_s)
        except httpx.HTTPError as error:
            raise UnavailableError(
                f"model '{self.spec.model_id}': the API at {base_url} cannot be reached ({type(error).__name__})"
            ) from None
        if response.status_code in (401, 403):
            raise ModelConfigError(
                f"model '{self.spec.model_id}': the API at {base_url} refused the key "
                f"({response.status_code}); check api_key_file"
            )
        if response.status_code != 200:
            raise UnavailableError(
                f"model '{self.spec.model_id}': GET {base_url}/models answered {response.status_code}: "
                f"{response.text[:300]}"
            )

    def _gone_message(self) -> str:
        return f"remote model '{self.spec.model_id}' is not loaded"
