"""Inferential 1.4.0's own server in a subprocess, for side-by-side benchmarks.

    from _inferential import inferential_server

    with inferential_server("model_deadline", max_inflight={"sleep": 1},
                            budgets_ms={"robot-0": 30.0}) as address:
        ...  # point stock `inferential.Connection(server=address)` clients at it

It runs `inferential.Server` with a `LocalDispatcher` hosting the same example models
as Loadmaster (`examples/models/sleep` and `double`, their own `model.py` classes), bound to
a free 127.0.0.1 port, as Inferential's own documentation configures it: `mode="inline"`
(the default) hands `LocalDispatcher` the models' `infer` functions, which it calls inline
on the server's event loop. `mode="threaded"` is a variant of ours, not stock Inferential:
each call runs in a worker thread (`asyncio.to_thread`), `max_inflight` enforced around it,
so a slow model does not block the loop; it costs ~3x on a tiny model and must be labelled
as such wherever it is reported. The context manager yields the address
("tcp://127.0.0.1:PORT") once the server has answered a real `double` request, and
stops the process (SIGTERM, then SIGKILL) on exit, also on failure.

Parameters: `strategy` (any Inferential strategy name), `max_inflight` (model -> limit;
Inferential's default is 2), `budgets_ms` (client id -> latency budget; default 50),
`request_ttl_ms`, `log_path` (the server's stderr; default: discarded).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loadmaster.common.ports import free_port

__all__ = ["inferential_server"]

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "models"
_READY_TIMEOUT_S = 30.0


@contextmanager
def inferential_server(
    strategy: str = "model_deadline",
    *,
    max_inflight: dict[str, int] | None = None,
    budgets_ms: dict[str, float] | None = None,
    request_ttl_ms: float = 5000.0,
    log_path: Path | None = None,
    mode: str = "inline",
) -> Iterator[str]:
    """Yield the address of a running Inferential server (see the module docstring)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    spec = {
        "bind": address,
        "strategy": strategy,
        "max_inflight": max_inflight or {},
        "budgets_ms": budgets_ms or {},
        "request_ttl_ms": request_ttl_ms,
        "mode": mode,
    }
    if mode not in ("inline", "threaded"):
        raise ValueError(f"mode must be 'inline' (stock) or 'threaded', not {mode!r}")
    log = open(log_path, "wb") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, __file__, json.dumps(spec)],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        _wait_ready(address, proc)
        yield address
    finally:
        _stop(proc)
        if log_path is not None:
            log.close()  # type: ignore[union-attr]


def _wait_ready(address: str, proc: subprocess.Popen[bytes]) -> None:
    import numpy as np
    from inferential import Connection

    conn = Connection(server=address, client_id="bench-ready-probe")
    try:
        conn.model("double").observe(x=np.ones(2, dtype=np.float32))
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the Inferential server exited with {proc.returncode}")
            if conn.model("double").get_result(timeout_ms=200) is not None:
                return
        raise TimeoutError(f"the Inferential server at {address} did not answer in {_READY_TIMEOUT_S:.0f} s")
    finally:
        conn.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=5)


# ---- the child process ---------------------------------------------------------------


def _load_model(name: str) -> Any:
    folder = MODELS / name
    import yaml

    config = yaml.safe_load((folder / "config.yaml").read_text())
    spec = importlib.util.spec_from_file_location(f"inferential_bench_{name}", folder / config["module"])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    instance = getattr(module, config["class"])()
    if hasattr(instance, "load"):
        instance.load()
    return instance


def _serve(spec: dict[str, Any]) -> None:
    import asyncio

    import numpy as np
    from inferential import LocalDispatcher, Server
    from inferential.config.schema import ClientEntry, InferentialConfig, ModelConfig

    def inline(model: Any) -> Any:
        # As Inferential's README shows: the model's function, called inline by LocalDispatcher.
        def call(obs: dict[str, Any]) -> dict[str, Any]:
            return model.infer({k: v for k, v in obs.items() if isinstance(v, np.ndarray)})

        return call

    def threaded(model: Any, limit: int | None) -> Any:
        # `limit` calls at once, like a Loadmaster worker's max_inflight, so both servers
        # have the same capacity (Inferential dispatches up to max_concurrent_dispatch at once).
        gate = asyncio.Semaphore(limit) if limit else None

        async def call(obs: dict[str, Any]) -> dict[str, Any]:
            inputs = {k: v for k, v in obs.items() if isinstance(v, np.ndarray)}
            if gate is None:
                return await asyncio.to_thread(model.infer, inputs)
            async with gate:
                return await asyncio.to_thread(model.infer, inputs)

        return call

    config = InferentialConfig()
    config.transport.bind = spec["bind"]
    config.scheduling.strategy = spec["strategy"]
    config.scheduling.request_ttl_ms = spec["request_ttl_ms"]
    for model_id, limit in spec["max_inflight"].items():
        config.models.known[model_id] = ModelConfig(max_inflight=limit)
    config.clients.known = [
        ClientEntry(id=client, model="sleep", latency_budget_ms=budget)
        for client, budget in spec["budgets_ms"].items()
    ]

    async def main() -> None:
        limits = spec["max_inflight"]
        loaded = {name: _load_model(name) for name in ("sleep", "double")}
        if spec.get("mode", "inline") == "inline":
            models = {name: inline(model) for name, model in loaded.items()}
        else:
            models = {name: threaded(model, limits.get(name)) for name, model in loaded.items()}
        await Server(config=config, dispatcher=LocalDispatcher(models)).run()

    asyncio.run(main())


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
