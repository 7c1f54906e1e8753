"""The worker's session channel to the scheduler is a live link (docs/liveness.md): a silent
scheduler is left within 1.8 s, for a reconnect (perhaps to a standby that took over)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from loadmaster.common.liveness import LIVENESS
from loadmaster.model_pool import worker_session
from loadmaster.model_pool.worker_session import WorkerIdentity, WorkerSession


class _Pool:
    def add_listener(self, listener: Any) -> None:
        pass


async def test_the_session_channel_gets_the_live_links_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[dict[str, object]] = []

    def channel(address: str, *, options: list[tuple[str, object]] | None = None) -> None:
        opened.append(dict(options or []))
        raise OSError("no network in a unit test")

    monkeypatch.setattr(worker_session, "aio_channel", channel)
    session = WorkerSession(
        "127.0.0.1:1",
        _Pool(),  # type: ignore[arg-type]
        identity=WorkerIdentity("w", "tcp://127.0.0.1:2", "127.0.0.1:3", "n"),
    )
    session.start()
    for _ in range(100):
        if opened:
            break
        await asyncio.sleep(0.01)
    await session.stop()
    assert opened
    assert set(dict(LIVENESS.grpc_options()).items()) <= set(opened[0].items())
