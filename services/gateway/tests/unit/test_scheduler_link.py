"""The Session outbox: what goes into which message (no stream; the generator is driven by hand)."""

from __future__ import annotations

from loadmaster.gateway.scheduler_link import SchedulerLink
from loadmaster.v1 import scheduler_pb2


def _run(request_id: str, credit_id: str) -> scheduler_pb2.RequestInfo:
    return scheduler_pb2.RequestInfo(request_id=request_id, model_id="double", credit_id=credit_id)


async def test_a_second_run_on_a_credit_waits_for_the_message_after_its_predecessor() -> None:
    link = SchedulerLink("127.0.0.1:1", "gw", on_grant=print, on_reject=print, on_lost=print)
    link._connected.set()  # as after the stream opened
    outgoing = link._outgoing(link._outbox)
    hello = await anext(outgoing)
    assert hello.HasField("hello")
    # The writer was busy: r1's run, its Complete and r2's run on the same credit all wait.
    link.enqueue(_run("r1", "c1"))
    link.complete("r1")
    link.enqueue(_run("r2", "c1"))
    link.enqueue(_run("r3", "c2"))
    first, second = await anext(outgoing), await anext(outgoing)
    assert [e.request.request_id for e in first.enqueue] == ["r1"] and not first.complete
    assert [c.request_id for c in second.complete] == ["r1"]
    assert [e.request.request_id for e in second.enqueue] == ["r2", "r3"]
