"""The one place the scheduler's and the workers' messages are told apart.

Two components hold the gateway's requests in flight: the `Dispatcher` its tensor calls,
`GenerationStreams` its generation streams. Both send on the same scheduler session and the
same worker links, and what comes back on them goes through here to the one that owns it:

    scheduler session  grant, reject    -> the stream's owner, else the dispatcher
                       credit, revoke   -> the dispatcher (shares of slots are for tensor calls)
                       placement        -> the streams (where each generative model is served)
                       session lost     -> both
    worker links       InferResponse    -> the dispatcher
                       GenerateReplies  -> the streams
                       link lost        -> both

Neither component relays the other's traffic (before issue 35 the dispatcher owned the
streams and passed five kinds of message on to them).
"""

from __future__ import annotations

from typing import Any

from loadmaster.gateway.dispatcher import Dispatcher
from loadmaster.gateway.generations import GenerationStreams
from loadmaster.v1 import model_pool_pb2, scheduler_pb2

__all__ = ["Demux"]


class Demux:
    """Callbacks for `SchedulerLink` and `WorkerLinks`; `calls` and `streams` are set once both
    exist (the links are made first: the two components send on them)."""

    def __init__(self) -> None:
        self.calls: Dispatcher | None = None
        self.streams: GenerationStreams | None = None

    def _both(self) -> tuple[Dispatcher, GenerationStreams]:
        assert self.calls is not None and self.streams is not None, "the gateway is not assembled yet"
        return self.calls, self.streams

    # ---- the scheduler session ---------------------------------------------------------

    def on_grant(self, grant: scheduler_pb2.Grant) -> None:
        calls, streams = self._both()
        if streams.on_grant(grant):
            calls.heard_from_scheduler()  # any grant shows the session serves: a lost one's credits go
        else:
            calls.on_grant(grant)

    def on_reject(self, reject: scheduler_pb2.Reject) -> None:
        calls, streams = self._both()
        if not streams.on_reject(reject):
            calls.on_reject(reject)

    def on_credit(self, credit: scheduler_pb2.Credit) -> None:
        self._both()[0].on_credit(credit)

    def on_revoke(self, credit_id: str) -> None:
        self._both()[0].on_revoke(credit_id)

    def on_placement(self, placement: scheduler_pb2.Placement) -> None:
        self._both()[1].on_placement(placement)

    def on_scheduler_lost(self) -> None:
        calls, streams = self._both()
        streams.on_scheduler_lost()
        calls.on_scheduler_lost()

    # ---- the worker links --------------------------------------------------------------

    def on_worker_reply(self, reply: model_pool_pb2.InferResponse, payload: Any) -> None:
        self._both()[0].on_worker_reply(reply, payload)

    def on_generation_replies(self, endpoint: str, replies: model_pool_pb2.GenerateReplies) -> None:
        self._both()[1].on_replies(endpoint, replies)

    def on_worker_lost(self, endpoint: str) -> None:
        calls, streams = self._both()
        streams.on_worker_lost(endpoint)
        calls.on_worker_lost(endpoint)
