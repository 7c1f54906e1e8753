"""Generation streams in the gateway (`GenerationStreams`), with recording stand-ins for the
scheduler session and the worker links (its two collaborators): queued like any request, the
grant held to the terminal, replies checked for order, cancel while queued or running, retry
before the first chunk, a deadline that passed while queued."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from loadmaster.common import internal_auth
from loadmaster.common.credentials import Credentials, Identity
from loadmaster.common.errors import ExpiredError, InternalError, InvalidArgumentError, UnavailableError
from loadmaster.common.framing import GENERATE_CANCEL_FRAME, GENERATE_REQUEST_FRAME
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.catalog import ModelView
from loadmaster.gateway.frontends.openai_schema import parse_chat, parse_completion
from loadmaster.gateway.generation import Finished, TextChunk, Waiting
from loadmaster.gateway.generations import GenerationRouter, GenerationStreams
from loadmaster.v1 import errors_pb2, model_pool_pb2, scheduler_pb2

ENDPOINT = "tcp://127.0.0.1:1"


class Scheduler:
    connected = True
    session = 1

    def __init__(self) -> None:
        self.enqueued: list[scheduler_pb2.RequestInfo] = []
        self.completed: list[tuple[str, int, bool]] = []
        self.cancelled: list[str] = []

    def enqueue(self, request: scheduler_pb2.RequestInfo) -> None:
        self.enqueued.append(request)

    def complete(self, request_id: str, *, error_code: int = 0, retryable: bool = False, **_: Any) -> None:
        self.completed.append((request_id, error_code, retryable))

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


class Workers:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []

    def send_generation(self, endpoint: str, kind: bytes, envelope: bytes) -> None:
        self.sent.append((endpoint, kind, envelope))

    def requests(self) -> list[model_pool_pb2.GenerateRequest]:
        return [
            model_pool_pb2.GenerateRequest.FromString(e)
            for _, k, e in self.sent
            if k == GENERATE_REQUEST_FRAME
        ]

    def cancels(self) -> list[str]:
        return [
            model_pool_pb2.CancelGeneration.FromString(e).request_id
            for _, k, e in self.sent
            if k == GENERATE_CANCEL_FRAME
        ]


@pytest.fixture
def parts() -> tuple[GenerationStreams, Scheduler, Workers]:
    scheduler, workers = Scheduler(), Workers()
    streams = GenerationStreams(
        scheduler=scheduler, workers=workers, telemetry=TelemetryReporter("gateway", "test", None)
    )
    return streams, scheduler, workers


BODY = b'{"model": "tiny-chat", "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "seed": 7, "stop": ["x"], "x_priority": 0, "x_urgency": 0.5, "x_deadline_ms": 250}'


def grant(request_id: str, worker: str = "w1") -> scheduler_pb2.Grant:
    return scheduler_pb2.Grant(
        request_id=request_id, worker_id=worker, data_endpoint=ENDPOINT, generation=3, attempt=1
    )


def replies(
    request_id: str, *kinds: tuple[int, str, Any], worker: str = "w1"
) -> model_pool_pb2.GenerateReplies:
    out = model_pool_pb2.GenerateReplies()
    for sequence, kind, value in kinds:
        reply = out.replies.add(
            request_id=request_id, model_id="tiny-chat", sequence=sequence, worker_id=worker
        )
        if kind == "chunk":
            reply.chunk.text = value
        elif kind == "result":
            reply.result.finish_reason = model_pool_pb2.FINISH_REASON_LENGTH
            reply.result.usage.prompt_tokens, reply.result.usage.completion_tokens = value
        elif kind == "error":
            reply.error.error_code, reply.error.error_message, reply.error.retryable = value
        elif kind == "cancelled":
            reply.cancelled.reason = value
    return out


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_generation_is_queued_granted_streamed_and_completed(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, scheduler, workers = parts
    events = streams.generate(parse_chat(BODY), request_id="g1", client_id="arm")
    first = asyncio.ensure_future(anext(events))
    await settle()
    [info] = scheduler.enqueued
    assert (info.model_id, info.priority, info.client_id, info.timeout_ms) == ("tiny-chat", 0, "arm", 250)
    assert info.urgency == pytest.approx(0.5)
    assert streams.on_grant(grant("g1"))
    [sent] = workers.requests()
    assert (sent.generation, sent.priority, sent.sampling.max_tokens, sent.sampling.seed) == (3, 0, 5, 7)
    assert [(m.role, m.content) for m in sent.messages.messages] == [("system", "be brief"), ("user", "hi")]
    assert sent.sampling.temperature == 0.0 and sent.sampling.HasField("temperature")
    streams.on_replies(ENDPOINT, replies("g1", (0, "chunk", "he"), (1, "chunk", "llo")))
    assert await first == TextChunk("hello")  # chunks already waiting travel as one
    streams.on_replies(ENDPOINT, replies("g1", (2, "result", (9, 5))))
    assert await anext(events) == Finished("length", prompt_tokens=9, completion_tokens=5, model="tiny-chat")
    assert scheduler.completed == [("g1", 0, False)] and streams.open == 0
    assert not streams.on_grant(grant("other"))  # not a generation: the dispatcher's


async def test_a_gap_in_the_stream_fails_it_and_frees_the_slot(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, scheduler, workers = parts
    events = streams.generate(parse_chat(BODY), request_id="g1", client_id="c")
    first = asyncio.ensure_future(anext(events))
    await settle()
    streams.on_grant(grant("g1"))
    streams.on_replies(ENDPOINT, replies("g1", (0, "chunk", "a"), (2, "chunk", "c")))
    assert await first == TextChunk("a")
    with pytest.raises(InternalError, match="missing"):
        await anext(events)
    assert workers.cancels() == ["g1"]
    assert scheduler.completed == [("g1", errors_pb2.ERROR_CODE_INTERNAL, False)]


async def test_closing_while_queued_cancels_at_the_scheduler_and_while_running_at_the_worker(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, scheduler, workers = parts
    queued = streams.generate(parse_chat(BODY), request_id="q", client_id="c")
    waiting = asyncio.ensure_future(anext(queued))
    await settle()
    waiting.cancel()
    await settle()
    await queued.aclose()
    assert scheduler.cancelled == ["q"] and streams.open == 0

    running = streams.generate(parse_chat(BODY), request_id="r", client_id="c")
    first = asyncio.ensure_future(anext(running))
    await settle()
    streams.on_grant(grant("r"))
    streams.on_replies(ENDPOINT, replies("r", (0, "chunk", "a")))
    assert await first == TextChunk("a")
    await running.aclose()
    assert workers.cancels() == ["r"] and scheduler.completed == []  # the slot is held until...
    streams.on_replies(ENDPOINT, replies("r", (1, "chunk", "b"), (2, "cancelled", "gone")))
    assert scheduler.completed == [("r", errors_pb2.ERROR_CODE_CANCELLED, False)]  # ...the terminal
    assert streams.open == 0


async def test_a_retryable_error_before_the_first_chunk_goes_back_to_the_scheduler(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, scheduler, workers = parts
    events = streams.generate(parse_chat(BODY), request_id="g", client_id="c")
    first = asyncio.ensure_future(anext(events))
    await settle()
    streams.on_grant(grant("g", "w1"))
    unloading = (errors_pb2.ERROR_CODE_UNAVAILABLE, "the model was unloaded", True)
    streams.on_replies(ENDPOINT, replies("g", (0, "error", unloading)))
    assert scheduler.completed == [("g", errors_pb2.ERROR_CODE_UNAVAILABLE, True)]
    streams.on_grant(grant("g", "w2"))  # re-granted elsewhere: numbering starts again
    streams.on_replies(ENDPOINT, replies("g", (0, "chunk", "x"), worker="w1"))  # late, ignored
    streams.on_replies(ENDPOINT, replies("g", (0, "chunk", "ok"), worker="w2"))
    assert await first == TextChunk("ok")
    bad = (errors_pb2.ERROR_CODE_INVALID_ARGUMENT, "stop[0]: bad", False)
    streams.on_replies(ENDPOINT, replies("g", (1, "error", bad), worker="w2"))
    with pytest.raises(InvalidArgumentError, match="stop"):
        await anext(events)
    assert len(workers.requests()) == 2


async def test_a_deadline_passed_while_queued_is_expired_and_a_lost_worker_unavailable(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, _, _ = parts
    queued = streams.generate(parse_chat(BODY), request_id="late", client_id="c")
    waiting = asyncio.ensure_future(anext(queued))
    await settle()
    streams.on_reject(
        scheduler_pb2.Reject(request_id="late", error_code=errors_pb2.ERROR_CODE_EXPIRED, message="expired")
    )
    with pytest.raises(ExpiredError):
        await waiting
    running = streams.generate(parse_chat(BODY), request_id="r", client_id="c")
    first = asyncio.ensure_future(anext(running))
    await settle()
    streams.on_grant(grant("r"))
    streams.on_replies(ENDPOINT, replies("r", (0, "chunk", "a")))
    assert await first == TextChunk("a")
    streams.on_worker_lost(ENDPOINT)
    with pytest.raises(UnavailableError, match="went away"):
        await anext(running)


async def test_a_stream_whose_worker_went_away_mid_way_ends_and_never_restarts_elsewhere(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    """The scheduler re-queues what a vanished worker held; a stream that already sent text
    cannot start over on another worker (its client would read it twice): a re-grant ends it,
    and a stream failed on the lost link is withdrawn from the scheduler's queue too."""
    streams, scheduler, workers = parts
    regranted = streams.generate(parse_chat(BODY), request_id="a", client_id="c")
    first = asyncio.ensure_future(anext(regranted))
    await settle()
    streams.on_grant(grant("a"))
    streams.on_replies(ENDPOINT, replies("a", (0, "chunk", "once")))
    assert await first == TextChunk("once")
    streams.on_grant(grant("a", worker="w2"))  # the scheduler noticed w1's end first
    with pytest.raises(UnavailableError, match="w1 went away"):
        await asyncio.wait_for(anext(regranted), 5)
    assert len(workers.requests()) == 1, "started over on w2"
    assert scheduler.completed[-1] == ("a", errors_pb2.ERROR_CODE_CANCELLED, False)  # w2's slot back

    lost = streams.generate(parse_chat(BODY), request_id="b", client_id="c")
    first = asyncio.ensure_future(anext(lost))
    await settle()
    streams.on_grant(grant("b"))
    streams.on_replies(ENDPOINT, replies("b", (0, "chunk", "x")))
    await first
    streams.on_worker_lost(ENDPOINT)  # the gateway noticed first, or the scheduler did
    with pytest.raises(UnavailableError):
        await asyncio.wait_for(anext(lost), 5)
    assert scheduler.completed[-1] == ("b", errors_pb2.ERROR_CODE_UNAVAILABLE, False)
    assert scheduler.cancelled == ["b"]
    assert streams.open == 0


async def test_the_port_lists_generative_models_with_their_state(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    views = {
        "tiny-chat": ModelView("tiny-chat", "READY", backend="transformers"),
        "big-chat": ModelView("big-chat", "UNAVAILABLE", "not loaded", backend="transformers"),
        "double": ModelView("double", "READY", backend="python"),
    }

    async def models() -> dict[str, ModelView]:
        return views

    port = GenerationRouter(parts[0], models)
    assert await port.models() == {"tiny-chat": "READY", "big-chat": "IDLE"}


async def test_with_internal_credentials_requests_and_cancels_are_signed(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, _, workers = parts
    secret = b"s" * 32
    internal_auth.setup(Credentials(secret, Identity.parse("gateway/g1")))
    try:
        events = streams.generate(parse_chat(BODY), request_id="g", client_id="c")
        first = asyncio.ensure_future(anext(events))
        await settle()
        streams.on_grant(grant("g"))
        streams.on_replies(ENDPOINT, replies("g", (0, "chunk", "a")))
        assert await first == TextChunk("a")
        await events.aclose()
    finally:
        internal_auth.setup(None)
    worker = Credentials(secret, Identity.parse("model-pool/w1"))
    [request] = workers.requests()
    assert worker.verify_envelope(request.metadata, "g") == Identity.parse("gateway/g1")
    [(_, _, envelope)] = [sent for sent in workers.sent if sent[1] == GENERATE_CANCEL_FRAME]
    cancel = model_pool_pb2.CancelGeneration.FromString(envelope)
    assert worker.verify_envelope(cancel.metadata, "cancel:g") == Identity.parse("gateway/g1")


async def test_models_served_by_engine_processes_are_generative(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    views = {"tiny-chat-process": ModelView("tiny-chat-process", "READY", backend="openai_process")}

    async def models() -> dict[str, ModelView]:
        return views

    assert await GenerationRouter(parts[0], models).models() == {"tiny-chat-process": "READY"}


async def test_response_format_travels_to_the_worker(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, _, workers = parts
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    formats = {
        "s": {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}},
        "o": {"type": "json_object"},
        "t": {"type": "text"},
    }
    for request_id, response_format in formats.items():
        body = json.loads(BODY) | {"response_format": response_format}
        events = streams.generate(parse_chat(json.dumps(body).encode()), request_id=request_id, client_id="c")
        pending = asyncio.ensure_future(anext(events))
        await settle()
        streams.on_grant(grant(request_id))
        pending.cancel()
    sent = {message.request_id: message for message in workers.requests()}
    assert sent["s"].response_format.type == "json_schema" and sent["s"].response_format.name == "thing"
    assert json.loads(sent["s"].response_format.json_schema) == schema
    assert sent["o"].response_format.type == "json_object" and not sent["o"].response_format.json_schema
    assert not sent["t"].HasField("response_format")  # free text: nothing to enforce


async def test_the_tenant_and_its_weight_travel_to_the_worker(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, _, workers = parts
    streams.weights = {"acme": 3.0}.get  # type: ignore[assignment]
    events = streams.generate(parse_chat(BODY), request_id="g1", client_id="arm", tenant="acme")
    first = asyncio.ensure_future(anext(events))
    await settle()
    streams.on_grant(grant("g1"))
    [sent] = workers.requests()
    assert (sent.tenant, sent.tenant_weight) == ("acme", 3.0)
    streams.on_replies(ENDPOINT, replies("g1", (0, "result", (3, 0))))
    assert isinstance(await first, Finished)


async def test_a_workers_progress_reply_becomes_waiting_before_the_first_chunk(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, _, _ = parts
    events = streams.generate(parse_chat(BODY), request_id="g1", client_id="arm")
    first = asyncio.ensure_future(anext(events))
    await settle()
    streams.on_grant(grant("g1"))
    progress = model_pool_pb2.GenerateReplies()
    reply = progress.replies.add(request_id="g1", model_id="tiny-chat", worker_id="w1")
    reply.progress.queued_ahead = 4
    streams.on_replies(ENDPOINT, progress)
    assert await asyncio.wait_for(first, 1) == Waiting(queued_ahead=4)
    streams.on_replies(ENDPOINT, replies("g1", (0, "chunk", "hi"), (1, "result", (3, 1))))
    assert await anext(events) == TextChunk("hi")
    assert isinstance(await anext(events), Finished)


async def test_a_stream_not_granted_while_its_model_loads_is_told_how_far_the_load_is(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, _, _ = parts
    clock_ms = time.time() * 1000
    views = iter(
        [
            ModelView("tiny-chat", "LOADING"),  # never measured: just "loading"
            ModelView("tiny-chat", "LOADING", load_started_unix_ms=int(clock_ms - 1000), load_time_ms=4000),
        ]
    )

    async def view(model_id: str) -> ModelView | None:
        return next(views, ModelView("tiny-chat", "READY"))

    streams.model_view = view
    events = streams.generate(parse_chat(BODY), request_id="g1", client_id="arm")
    async with asyncio.timeout(5):
        first = await anext(events)
        second = await anext(events)
    assert first == Waiting(loading=True)
    # told about 1.5 s after it opened: (1 s before + 1.5 s) / 4 s, give or take a loaded machine
    assert second.loading and second.load_fraction is not None and 0.55 <= second.load_fraction <= 0.95
    await events.aclose()


async def test_streams_not_granted_and_not_loading_count_the_streams_ahead_at_this_gateway(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, _, _ = parts
    older = streams.generate(parse_chat(BODY), request_id="g1", client_id="arm")
    newer = streams.generate(parse_chat(BODY), request_id="g2", client_id="arm")
    async with asyncio.timeout(5):
        assert await anext(older) == Waiting(queued_ahead=0)
        assert await anext(newer) == Waiting(queued_ahead=1)
    await older.aclose()
    await newer.aclose()


async def test_tools_logprobs_and_n_reach_the_worker_and_choices_come_back_apart(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, _, workers = parts
    body = {
        "model": "tiny-chat",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "logprobs": True,
        "top_logprobs": 2,
        "n": 2,
    }
    events = streams.generate(parse_chat(json.dumps(body).encode()), request_id="t", client_id="c")
    first = asyncio.ensure_future(anext(events))
    await settle()
    assert streams.on_grant(grant("t"))
    [sent] = workers.requests()
    assert (sent.tools.choice, sent.tools.parallel, [f.name for f in sent.tools.functions]) == (
        "required",
        False,
        ["f"],
    )
    assert json.loads(sent.tools.functions[0].parameters_json) == {"type": "object"}
    assert (sent.logprobs.enabled, sent.logprobs.top, sent.n) == (True, 2, 2)
    history = sent.messages.messages
    assert [(c.id, c.name) for c in history[1].tool_calls] == [("c1", "f")]
    assert (history[2].role, history[2].tool_call_id) == ("tool", "c1")
    out = model_pool_pb2.GenerateReplies()
    for sequence, (choice, text) in enumerate([(0, "a"), (0, "b"), (1, "x"), (0, "c")]):
        reply = out.replies.add(request_id="t", model_id="tiny-chat", sequence=sequence, worker_id="w1")
        reply.chunk.text, reply.chunk.choice = text, choice
        reply.chunk.logprobs.add(token_id=1, token=text.encode(), logprob=-1.0).top.add(
            token_id=1, token=b"t", logprob=-1.0
        )
    call = out.replies.add(request_id="t", model_id="tiny-chat", sequence=4, worker_id="w1")
    call.chunk.choice = 1
    call.chunk.tool_calls.add(id="call_1", name="f", arguments="{}", index=0)
    end = out.replies.add(request_id="t", model_id="tiny-chat", sequence=5, worker_id="w1")
    end.result.finish_reason = model_pool_pb2.FINISH_REASON_TOOL_CALLS
    end.result.choices.add(index=0, finish_reason=model_pool_pb2.FINISH_REASON_LENGTH, completion_tokens=3)
    end.result.choices.add(
        index=1, finish_reason=model_pool_pb2.FINISH_REASON_TOOL_CALLS, completion_tokens=2
    )
    streams.on_replies(ENDPOINT, out)
    got = [await first]
    async for item in events:
        got.append(item)
    chunks = [item for item in got if isinstance(item, TextChunk)]
    assert [(c.choice, c.text) for c in chunks] == [
        (0, "ab"),
        (1, "x"),
        (0, "c"),
        (1, ""),
    ]  # joined within a choice only
    assert [len(c.logprobs) for c in chunks] == [2, 1, 1, 0] and chunks[0].logprobs[0].top[0].token == "t"
    assert [call.name for call in chunks[3].tool_calls] == ["f"]
    finished = got[-1]
    assert isinstance(finished, Finished) and finished.finish_reason == "tool_calls"
    assert [(e.index, e.finish_reason, e.completion_tokens) for e in finished.choices] == [
        (0, "length", 3),
        (1, "tool_calls", 2),
    ]


def placement(model: str, *workers: tuple[str, str, int]) -> scheduler_pb2.Placement:
    return scheduler_pb2.Placement(
        model_id=model,
        workers=[
            scheduler_pb2.PlacedWorker(worker_id=w, data_endpoint=e, generation=g) for w, e, g in workers
        ],
    )


async def test_a_generation_for_a_placed_model_goes_straight_to_a_worker(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, scheduler, workers = parts
    streams.on_placement(placement("tiny-chat", ("w1", ENDPOINT, 7)))
    events = streams.generate(parse_chat(BODY), request_id="g1", client_id="arm", tenant="t")
    first = asyncio.ensure_future(anext(events))
    await settle()
    [sent] = workers.requests()
    assert scheduler.enqueued == [] and sent.generation == 7 and sent.deadline_unix_ns > 0
    streams.on_replies(ENDPOINT, replies("g1", (0, "chunk", "hi"), (1, "result", (3, 1))))
    assert await first == TextChunk("hi")
    assert isinstance(await anext(events), Finished)
    assert scheduler.completed == []  # never queued there: nothing to tell it


async def test_placed_generations_spread_over_workers_and_follow_their_prompt_prefix(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, scheduler, workers = parts
    streams.on_placement(placement("tiny-chat", ("w1", "tcp://w1", 1), ("w2", "tcp://w2", 1)))
    plain = b'{"model": "tiny-chat", "prompt": "x", "max_tokens": 2}'
    opened = [streams.generate(parse_completion(plain), request_id=f"p{i}", client_id="a") for i in range(4)]
    waits = [asyncio.ensure_future(anext(events)) for events in opened]
    await settle()
    endpoints = [endpoint for endpoint, _, _ in workers.sent]
    assert sorted(endpoints) == ["tcp://w1", "tcp://w1", "tcp://w2", "tcp://w2"]  # the fewest placed first
    long_prompt = json.dumps(
        {
            "model": "tiny-chat",
            "messages": [{"role": "system", "content": "s" * 600}, {"role": "user", "content": "hi"}],
        }
    ).encode()
    same = [streams.generate(parse_chat(long_prompt), request_id=f"s{i}", client_id="a") for i in range(3)]
    more = [asyncio.ensure_future(anext(events)) for events in same]
    await settle()
    assert len({endpoint for endpoint, _, _ in workers.sent[4:]}) == 1  # one shared prefix: one worker
    assert scheduler.enqueued == []
    for wait in waits + more:
        wait.cancel()


async def test_a_placed_generation_whose_worker_goes_tries_another_then_the_scheduler(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, scheduler, workers = parts
    streams.on_placement(placement("tiny-chat", ("w1", "tcp://w1", 1), ("w2", "tcp://w2", 1)))
    events = streams.generate(parse_chat(BODY), request_id="g1", client_id="arm")
    first = asyncio.ensure_future(anext(events))
    await settle()
    tried = workers.sent[-1][0]
    streams.on_worker_lost(tried)
    assert workers.sent[-1][0] != tried and scheduler.enqueued == []
    streams.on_worker_lost(workers.sent[-1][0])  # the other goes too: through the scheduler
    [info] = scheduler.enqueued
    assert info.request_id == "g1"
    streams.on_grant(grant("g1", worker="w3"))
    streams.on_replies(ENDPOINT, replies("g1", (0, "chunk", "ok"), (1, "result", (3, 1)), worker="w3"))
    assert await first == TextChunk("ok")
    assert isinstance(await anext(events), Finished)
    assert [c[0] for c in scheduler.completed] == ["g1"]  # the scheduler's grant is given back


async def test_a_model_served_nowhere_is_queued_at_the_scheduler_again(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, scheduler, workers = parts
    streams.on_placement(placement("tiny-chat", ("w1", ENDPOINT, 1)))
    streams.on_placement(placement("tiny-chat"))  # unloaded everywhere
    events = streams.generate(parse_chat(BODY), request_id="g1", client_id="arm")
    first = asyncio.ensure_future(anext(events))
    await settle()
    assert [i.request_id for i in scheduler.enqueued] == ["g1"] and workers.sent == []
    first.cancel()


async def test_a_drain_refuses_new_streams_and_waits_for_the_open_ones(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, _scheduler, _workers = parts
    events = streams.generate(parse_chat(BODY), request_id="g1", client_id="arm")
    first = asyncio.ensure_future(anext(events))
    await settle()
    assert streams.on_grant(grant("g1"))
    drained = asyncio.ensure_future(streams.drain(5.0))
    await settle()
    assert not drained.done()  # g1 is still running
    with pytest.raises(UnavailableError, match="shutting down"):
        await anext(streams.generate(parse_chat(BODY), request_id="g2", client_id="arm"))
    streams.on_replies(ENDPOINT, replies("g1", (0, "chunk", "ok"), (1, "result", (9, 1))))
    assert await first == TextChunk("ok")
    assert isinstance(await anext(events), Finished)
    assert await asyncio.wait_for(drained, 1.0) == 0


async def test_a_drain_that_runs_out_of_time_counts_the_streams_still_open(
    parts: tuple[GenerationStreams, Scheduler, Workers],
) -> None:
    streams, _scheduler, _workers = parts
    events = streams.generate(parse_chat(BODY), request_id="g1", client_id="arm")
    pending = asyncio.ensure_future(anext(events))
    await settle()
    assert await streams.drain(0.05) == 1  # queued, never granted
    pending.cancel()
