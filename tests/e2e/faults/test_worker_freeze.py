"""A model-pool worker frozen with SIGSTOP under ~100 requests/s (issue 33): its sockets stay
open and its kernel keeps acknowledging TCP, as for a hung host or a container that vanished,
so only unanswered probes find it (docs/liveness.md). Stock clients on the edge (`inferential`)
and KServe v2 over HTTP and gRPC (`tritonclient`) send `double` on a cadence the whole time,
and a streamed `tiny-chat` generation (`openai`) runs on the frozen worker.

Every request gets a reply (none waits for its client's own timeout), good replies come soon
after the freeze, every request the freeze held up is answered (re-granted to the other
worker, or `unavailable`) within a bound, the scheduler drops the frozen worker, and the
stream ends with an error event. The bounds are generous for a loaded 2-core host; the
promise is 2 s, measured by bench/worker_freeze.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import _liveness as liveness

pytestmark = pytest.mark.slow

BOUND_S = 5.0
RATES_HZ = {"edge": 40.0, "kserve_http": 30.0, "kserve_grpc": 30.0}
AFTER_S = 5.0  # load kept on after the freeze


def test_a_worker_frozen_under_load_loses_no_request_and_ends_its_stream(make_suite) -> None:
    suite = make_suite(workers=2, preload=["double"])
    scheduler = suite.settings.scheduler.address
    victim = suite.service("model-pool-1")
    assert victim is not None
    liveness.wait_for_workers(scheduler, 2, "double")
    liveness.load_model_on(victim.address, "tiny-chat")  # so the stream runs on the victim
    liveness.wait_for_workers(scheduler, 1, "tiny-chat")
    data_endpoint = liveness.data_endpoint_of(victim.address)
    gateway = suite.settings.gateway
    stream = liveness.StreamWatch(f"http://{gateway.http_host}:{gateway.http_port}/v1")
    callers = liveness.front_ends(suite)
    loads = [
        liveness.FrontEndLoad(name, callers[name], rate_hz=rate, clients=4) for name, rate in RATES_HZ.items()
    ]
    try:
        for load in loads:
            load.start()
        time.sleep(2.0)
        stream.start()
        assert stream.first_chunk.wait(60) and stream.chunks, f"the stream never started: {stream.outcome}"
        frozen_at = liveness.freeze(victim.process.pid)
        dropped_s = liveness.watch_scheduler_drop(scheduler, data_endpoint, frozen_at)
        time.sleep(max(0.0, frozen_at + AFTER_S - time.monotonic()))
        seen = {load.name: liveness.summarize(load.stop(), frozen_at) for load in loads}
        stream.join(liveness.NO_REPLY_S + 5)
    finally:
        liveness.thaw(victim.process.pid)
    ended_s = None if stream.ended_at is None else round(stream.ended_at - frozen_at, 3)
    print(
        json.dumps({**seen, "scheduler_dropped_s": dropped_s, "stream": [stream.outcome, ended_s]}, indent=1)
    )

    for name, front in seen.items():
        assert front["no_reply"] == 0, (name, front)
        assert front["first_good_reply_s"] is not None and front["first_good_reply_s"] <= BOUND_S, (
            name,
            front,
        )
        assert front["recovered_s"] <= BOUND_S, (name, front)
        assert front["rate_hz"] >= RATES_HZ[name] / 2, (name, front)  # the load did run
    assert sum(front["held_up"] for front in seen.values()) > 0, "the freeze held up no request"
    assert dropped_s is not None and dropped_s <= BOUND_S, "the scheduler kept the frozen worker"
    assert stream.outcome.startswith("error event"), stream.outcome
    assert ended_s is not None and ended_s <= BOUND_S
