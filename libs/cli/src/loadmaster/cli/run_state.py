"""What a running `loadmaster up` tells later commands: the embedded Redis's URL (with its
generated password), in a file only this user can read, named after the gateway's address
(one suite per address on a host), so `loadmaster status` finds the Redis of that suite."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["read_run_state", "remove_run_state", "run_state_path", "write_run_state"]


def run_state_path(gateway_address: str) -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    key = hashlib.sha256(gateway_address.encode()).hexdigest()[:16]
    return Path(base) / f"loadmaster-{os.getuid()}" / f"{key}.json"


def _private_folder(folder: Path) -> bool:
    """Whether `folder` is a real directory of this user that nobody else may write to (the
    temp folder is shared: another user could have made the folder, or put a link in it)."""
    try:
        info = folder.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022


def write_run_state(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private_folder(path.parent):
        raise PermissionError(
            f"{path.parent} is not a private folder of this user: not writing run state there"
        )
    # Written aside and renamed over the old file: a reader sees the old state or the new one,
    # never a truncated file (mkstemp makes it 0600 in the private folder).
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(state, file)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _running(pid: object) -> bool:
    """Whether `pid` is a live process of this user (a signal 0 reaches it)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or the number is another user's now
        return False
    return True


def read_run_state(path: Path) -> dict[str, Any]:
    """The state a running `loadmaster up` of this user wrote; nothing from a folder others
    control. State whose `up` is gone (killed before it could remove the file) is removed and
    reads as empty: a later suite on the same gateway address must not take that one's Redis
    or credential files, which went with it."""
    if not _private_folder(path.parent):
        return {}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as file:
            state = json.load(file)
    except (OSError, ValueError):
        return {}
    if not isinstance(state, dict):
        return {}
    if not _running(state.get("pid")):
        remove_run_state(path)
        return {}
    return state


def remove_run_state(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
