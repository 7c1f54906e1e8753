"""Loadmaster's own SDK (`loadmaster.client`, sync and asyncio) against the running suite."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from loadmaster.client import AsyncConnection, Connection, NoReplyError
from loadmaster.common.errors import InvalidArgumentError, NotFoundError


def test_sync_infer_and_typed_errors(edge_address: str) -> None:
    with Connection(edge_address) as conn:
        assert conn.client_id.startswith("lm-")
        out = conn.model("double").infer(x=np.arange(3, dtype=np.float32))
        np.testing.assert_array_equal(out["x"], [0.0, 2.0, 4.0])
        with pytest.raises(NotFoundError, match="no-such-model"):
            conn.model("no-such-model").infer(x=np.zeros(1, np.float32))
        with pytest.raises(InvalidArgumentError, match="'ms'"):
            conn.model("sleep").infer(ms=np.zeros(1, np.int64))


def test_default_client_ids_are_unique(edge_address: str) -> None:
    with Connection(edge_address) as a, Connection(edge_address) as b:
        assert a.client_id != b.client_id


def test_a_late_reply_is_never_returned_for_a_later_request(edge_address: str) -> None:
    with Connection(edge_address) as conn:
        sleep = conn.model("sleep")
        first = sleep.observe(ms=np.array([300], np.float32), tag=np.array([1], np.int64))
        assert sleep.get_result(timeout_ms=20) is None  # not yet: it stays outstanding
        second = sleep.observe(ms=np.array([0], np.float32), tag=np.array([2], np.int64))
        assert first != second
        one = sleep.get_result(timeout_ms=5000)
        two = sleep.get_result(timeout_ms=5000)
        assert one is not None and two is not None
        assert int(one["tag"][0]) == 1 and one["request_id"] == first
        assert int(two["tag"][0]) == 2 and two["request_id"] == second


def test_infer_timeout_drops_the_late_reply(edge_address: str) -> None:
    with Connection(edge_address) as conn:
        sleep = conn.model("sleep")
        with pytest.raises(NoReplyError):
            sleep.infer(
                ms=np.array([1500], np.float32), timeout_ms=10_000 - 9_700
            )  # 300 ms + 1 s grace < 1.5 s
        out = sleep.infer(ms=np.array([0], np.float32), tag=np.array([7], np.int64))
        assert int(out["tag"][0]) == 7  # not the late reply of the 1.5 s request


async def test_async_client_concurrent_infer(edge_address: str) -> None:
    async with AsyncConnection(edge_address, client_type="test") as conn:
        double = conn.model("double")
        outs = await asyncio.gather(*(double.infer(x=np.full(4, i, np.float32)) for i in range(32)))
        for i, out in enumerate(outs):
            np.testing.assert_array_equal(out["x"], np.full(4, 2 * i, np.float32))
        with pytest.raises(NotFoundError):
            await conn.model("no-such-model").infer(x=np.zeros(1, np.float32))


async def test_async_observe_and_get_result(edge_address: str) -> None:
    async with AsyncConnection(edge_address) as conn:
        sleep = conn.model("sleep", priority=0)
        request_id = sleep.observe(ms=np.array([200], np.float32))
        assert await sleep.get_result(timeout_ms=10) is None
        result = await sleep.get_result(timeout_ms=5000)
        assert result is not None and result["request_id"] == request_id
        assert await sleep.get_result(timeout_ms=10) is None  # nothing outstanding
        with pytest.raises(NoReplyError):
            await sleep.infer(ms=np.array([1500], np.float32), timeout_ms=300)
        out = await sleep.infer(ms=np.array([0], np.float32), tag=np.array([9], np.int64))
        assert int(out["tag"][0]) == 9
