"""The run state `up` leaves for later commands is written and read only in a private folder."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from loadmaster.cli.run_state import read_run_state, write_run_state


def test_a_private_folder_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "state" / "suite.json"
    write_run_state(path, {"pid": os.getpid(), "redis_url": "redis://:pw@127.0.0.1:1/0"})
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    assert read_run_state(path) == {"pid": os.getpid(), "redis_url": "redis://:pw@127.0.0.1:1/0"}


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
    assert read_run_state(folder / "suite.json") == {}
    write_run_state(
        folder / "suite.json", {"pid": os.getpid(), "redis_url": "x"}
    )  # replaces the link, not its target
    assert victim.read_text() == "keep me"
    assert not (folder / "suite.json").is_symlink()
    assert read_run_state(folder / "suite.json") == {"pid": os.getpid(), "redis_url": "x"}


def test_a_reader_never_sees_a_half_written_state(tmp_path: Path) -> None:
    path = tmp_path / "state" / "suite.json"
    state = {
        "pid": os.getpid(),
        "redis_url": "redis://:pw@127.0.0.1:1/0",
        "internal_auth": {"secret_file": "x" * 4096},
    }
    write_run_state(path, state)
    done = threading.Event()

    def rewrite() -> None:
        for _ in range(300):
            write_run_state(path, state)
        done.set()

    writer = threading.Thread(target=rewrite)
    writer.start()
    reads = 0
    while not done.is_set() and reads < 5000:
        assert read_run_state(path) == state
        reads += 1
    writer.join(timeout=30)
    assert reads > 0
    assert sorted(p.name for p in path.parent.iterdir()) == ["suite.json"]  # no temporary left


def test_the_state_of_an_up_that_died_reads_empty_and_is_removed(tmp_path: Path) -> None:
    """An `up` killed before it could remove its file leaves state naming a Redis and credential
    files that went with it; a later suite that gets the same gateway address must not use them."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    path = tmp_path / "state" / "suite.json"
    write_run_state(
        path, {"pid": int(gone.stdout), "internal_auth": {"secret_file": "/gone/internal.secret"}}
    )
    assert read_run_state(path) == {}
    assert not path.exists()


def test_state_that_names_no_process_reads_empty(tmp_path: Path) -> None:
    path = tmp_path / "state" / "suite.json"
    write_run_state(path, {"redis_url": "redis://:pw@127.0.0.1:1/0"})
    assert read_run_state(path) == {}
