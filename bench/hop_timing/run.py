"""Where one robot's round trip goes: the edge, `policy`, one call at a time, timed at ten points.

Not part of `make bench`: it needs the timestamps patched into the services for the run, and
taken out after (the patch applies to the commit that added it; later code may need it redone):

    git apply bench/hop_timing/stamps.patch
    PYTHONPATH=bench/hop_timing .venv/bin/python bench/hop_timing/run.py
    git checkout services/

Points: C0/C9 the client before `observe` and after `get_result`; G1 the gateway's edge reads the
frame, G2 it sends to the worker, G3 the worker's reply arrives, G4 the reply leaves for the
client; W1 the worker's data port takes the request (from either data link), W2 the batcher
hands the batch to the instance thread, W3 the thread starts it, W4 it ends, W5 the loop takes
the results, W6 the loop turn's replies start to leave. Prints the median and mean of each segment over 3,000 calls (after 300 to warm up).
"""

from __future__ import annotations

import collections
import itertools
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lmstamp  # from PYTHONPATH, as the patched services import it
from _harness import running_suite_handle

CALLS = 3000
ORDER = ["C0", "G1", "G2", "W1", "W2", "W3", "W4", "W5", "W6", "G3", "G4", "C9"]


def main() -> int:
    from inferential import Connection

    with running_suite_handle(preload=["policy"]) as suite:
        conn = Connection(server=suite.settings.gateway.edge.bind, client_id=f"hops-{uuid.uuid4().hex[:6]}")
        model = conn.model("policy")
        state = np.zeros((1, 32), np.float32)
        for _ in range(300):
            model.observe(state=state)
            model.get_result(timeout_ms=5000)
        for old in lmstamp.FOLDER.glob("*.txt"):
            old.unlink()
        time.sleep(0.5)
        for _ in range(CALLS):
            lmstamp.stamp("C0")
            model.observe(state=state)
            model.get_result(timeout_ms=5000)
            lmstamp.stamp("C9")
        conn.close()
    lmstamp.flush()
    events = sorted(
        (int(ns), tag)
        for path in lmstamp.FOLDER.glob("*.txt")
        for tag, ns in (line.split() for line in path.read_text().splitlines())
    )
    segments: dict[str, list[float]] = collections.defaultdict(list)
    current: dict[str, int] | None = None
    for ns, tag in events:
        if tag == "C0":
            current = {"C0": ns}
        elif current is not None:
            current.setdefault(tag, ns)
            if tag == "C9":
                if all(point in current for point in ORDER):
                    for a, b in itertools.pairwise(ORDER):
                        segments[f"{a}->{b}"].append((current[b] - current[a]) / 1000)
                    segments["total"].append((current["C9"] - current["C0"]) / 1000)
                current = None
    for name, values in segments.items():
        print(
            f"{name:8s} p50 {np.percentile(values, 50):7.1f} us   mean {np.mean(values):7.1f} us   n={len(values)}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
