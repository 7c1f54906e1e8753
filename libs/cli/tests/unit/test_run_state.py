"""The run state `up` leaves for later commands is written and read only in a private folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loadmaster.cli.run_state import read_run_state, write_run_state


def test_a_private_folder_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "state" / "suite.json"
    write_run_state(path, {"redis_url": "redis://:pw@127.0.0.1:1/0"})
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    assert read_run_state(path) == {"redis_url": "redis://:pw@127.0.0.1:1/0"}


def test_a_folder_others_may_write_is_neither_written_nor_read(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # as if another user had made it in the temp folder
    with pytest.raises(PermissionError):
        write_run_state(shared / "suite.json", {"redis_url": "x"})
    (shared / "suite.json").write_text('{"redis_url": "redis://attacker"}')
    assert read_run_state(shared / "suite.json") == {}


def test_a_planted_link_is_not_followed(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    (folder / "suite.json").symlink_to(victim)
    with pytest.raises(OSError):
        write_run_state(folder / "suite.json", {"redis_url": "x"})
    assert victim.read_text() == "keep me"
    assert read_run_state(folder / "suite.json") == {}
