"""Engine instances: copies of one model's engine, each on its own thread (`InstanceThread`).

An engine's methods run on its instance's thread only, never on the event loop (see
engines/base.py), so a slow load or model never stalls the worker and engines may keep
thread-affine state. The pool builds instances here and frees them here; the batcher
feeds them.
"""

from __future__ import annotations

import asyncio
import logging

from loadmaster.model_pool.batcher import Instance
from loadmaster.model_pool.engines import Engine, EngineContext
from loadmaster.model_pool.instance_thread import InstanceThread
from loadmaster.model_pool.repository import ModelSpec

__all__ = ["free_instances", "load_instance"]

log = logging.getLogger(__name__)


def _load_and_warm(engine: Engine) -> None:
    engine.load()
    engine.warmup()


async def load_instance(
    built: list[Instance], cls: type[Engine], spec: ModelSpec, context: EngineContext, *, name: str
) -> None:
    """Add one instance to `built`, then load it and run its warm-up (config inputs, or zeros from
    the declared inputs) on its thread. It joins `built` first, so a failed load frees it too."""
    thread = InstanceThread(name)
    try:
        engine = cls(spec, context)
    except BaseException:
        thread.shutdown()
        raise
    built.append(Instance(engine=engine, thread=thread))
    await asyncio.wrap_future(thread.submit(_load_and_warm, engine))


async def free_instances(model_id: str, instances: list[Instance]) -> None:
    """Unload every instance on its own thread and stop the threads; errors are logged."""
    for instance in instances:
        try:
            # Queued behind a load still running on that thread, so it frees what it built.
            await asyncio.wrap_future(instance.thread.submit(instance.engine.unload))
        except Exception:
            log.exception("unloading an instance of %s failed", model_id)
        finally:
            instance.thread.shutdown()
