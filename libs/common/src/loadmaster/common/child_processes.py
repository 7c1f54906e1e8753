"""Child-process hygiene: the launcher's services, the embedded Redis, `gpu lease -- CMD` and
the model pool's engine processes all start their children this way: in a session of their
own (`start_new_session=True`, so the child's whole process group can be signalled) and
wrapped by `die_with_parent`, so no child outlives a parent killed with SIGKILL."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

__all__ = ["die_with_parent", "signal_group"]


def die_with_parent(argv: list[str], *, signal_name: str = "TERM") -> list[str]:
    """`argv` wrapped so the kernel sends the child SIGTERM (or `signal_name`) when its parent dies.

    util-linux's `setpriv --pdeathsig` sets PR_SET_PDEATHSIG and execs the command, which
    keeps it across exec. (A `preexec_fn` would do the same from Python, but it forces a
    real fork() of a process that may run gRPC threads, whose fork handlers can then abort
    the child; without one, subprocess uses vfork/exec and no Python runs in the child.)
    Where setpriv is missing, the child simply runs without the guard.
    """
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return argv
    return [setpriv, "--pdeathsig", signal_name, "--", *argv]


def signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
