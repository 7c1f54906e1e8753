"""Child-process hygiene shared by the launcher and the embedded Redis."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess

__all__ = ["die_with_parent", "signal_group"]


def die_with_parent() -> None:
    """For `preexec_fn`: the kernel sends the child SIGTERM when its parent dies (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)


def signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
