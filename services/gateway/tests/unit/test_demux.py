"""`Demux`: what comes back on the scheduler session and the worker links reaches the component
that owns the request, and only that one (the recording doubles stand in for the dispatcher
and the streams; each says whether a grant or reject was one of its own)."""

from __future__ import annotations

from typing import Any

import pytest

from loadmaster.gateway.demux import Demux
from loadmaster.v1 import model_pool_pb2, scheduler_pb2


class _Recorder:
    def __init__(self, owns: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.owns = owns
        self.heard: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any) -> bool:
            self.heard.append(name)
            request_id = getattr(args[0], "request_id", None) if args else None
            return request_id in self.owns

        return record


@pytest.fixture()
def parts() -> tuple[Demux, _Recorder, _Recorder]:
    demux, calls, streams = Demux(), _Recorder(), _Recorder({"stream-1"})
    demux.calls, demux.streams = calls, streams  # type: ignore[assignment]
    return demux, calls, streams


def test_a_grant_goes_to_the_stream_that_owns_it_else_to_the_dispatcher(
    parts: tuple[Demux, _Recorder, _Recorder],
) -> None:
    demux, calls, streams = parts
    demux.on_grant(scheduler_pb2.Grant(request_id="stream-1"))
    assert calls.heard == ["heard_from_scheduler"]  # the session served: its credits count
    demux.on_grant(scheduler_pb2.Grant(request_id="call-1"))
    assert calls.heard == ["heard_from_scheduler", "on_grant"]  # (on_grant hears it itself)
    assert streams.heard == ["on_grant", "on_grant"]


def test_a_reject_goes_to_its_owner_only(parts: tuple[Demux, _Recorder, _Recorder]) -> None:
    demux, calls, streams = parts
    demux.on_reject(scheduler_pb2.Reject(request_id="stream-1"))
    assert calls.heard == []
    demux.on_reject(scheduler_pb2.Reject(request_id="call-1"))
    assert calls.heard == ["on_reject"] and streams.heard == ["on_reject", "on_reject"]


def test_each_kind_of_message_reaches_its_component(parts: tuple[Demux, _Recorder, _Recorder]) -> None:
    demux, calls, streams = parts
    demux.on_credit(scheduler_pb2.Credit(credit_id="c1"))
    demux.on_revoke("c1")
    demux.on_worker_reply(model_pool_pb2.InferResponse(request_id="call-1"), b"")
    demux.on_placement(scheduler_pb2.Placement(model_id="chat"))
    demux.on_generation_replies("tcp://w1", model_pool_pb2.GenerateReplies())
    assert calls.heard == ["on_credit", "on_revoke", "on_worker_reply"]
    assert streams.heard == ["on_placement", "on_replies"]


def test_a_lost_session_or_link_reaches_both(parts: tuple[Demux, _Recorder, _Recorder]) -> None:
    demux, calls, streams = parts
    demux.on_scheduler_lost()
    demux.on_worker_lost("tcp://w1")
    assert calls.heard == streams.heard == ["on_scheduler_lost", "on_worker_lost"]


def test_a_message_before_the_gateway_is_assembled_is_a_clear_error() -> None:
    with pytest.raises(AssertionError, match="not assembled"):
        Demux().on_credit(scheduler_pb2.Credit(credit_id="c1"))
