"""Timestamps at fixed points of a request's path, for bench/hop_timing/run.py only.

`stamp(tag)` appends (tag, CLOCK_MONOTONIC ns) in memory; every 4,000 and at exit they go to
/tmp/loadmaster-stamps/<pid>.txt. CLOCK_MONOTONIC is one clock for every process of a host, so
stamps of the client, gateway and worker line up.
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

FOLDER = Path("/tmp/loadmaster-stamps")
_stamps: list[tuple[str, int]] = []


def stamp(tag: str) -> None:
    _stamps.append((tag, time.monotonic_ns()))
    if len(_stamps) >= 4000:
        flush()


def flush() -> None:
    if not _stamps:
        return
    FOLDER.mkdir(exist_ok=True)
    with (FOLDER / f"{os.getpid()}.txt").open("a") as out:
        out.write("".join(f"{tag} {ns}\n" for tag, ns in _stamps))
    _stamps.clear()


atexit.register(flush)
