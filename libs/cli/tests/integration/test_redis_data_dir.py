"""The embedded redis-server on a data folder that is given (`loadmaster up`'s redis.data_dir):
its data outlive a stop and start, and a second server on the same folder is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from loadmaster.cli.redis_server import EmbeddedRedis


def test_data_survive_a_stop_and_a_second_server_on_the_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "redis"
    first = EmbeddedRedis(data_dir=str(folder)).start()
    try:
        redis.Redis.from_url(first.url).hset("loadmaster:admin:config", "scheduler.strategy", '"round_robin"')
        with pytest.raises(RuntimeError, match=f"{folder} is in use by another suite"):
            EmbeddedRedis(data_dir=str(folder)).start()
    finally:
        first.stop()
    assert folder.is_dir()  # a given folder is kept
    again = EmbeddedRedis(data_dir=str(folder)).start()  # a new port, the same password and data
    try:
        client = redis.Redis.from_url(again.url)
        assert client.hget("loadmaster:admin:config", "scheduler.strategy") == b'"round_robin"'
    finally:
        again.stop()
