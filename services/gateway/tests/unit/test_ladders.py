"""Model ladders (gateway/ladders.py): which model an alias goes to, how often the router looks
at the fleet (a fake clock), and the OpenAI front end answering an alias with the model that
answered (the `openai` client in-process over the real `GenerationStreams`, with recording
stand-ins for the scheduler session and the worker links)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette

from loadmaster.common.clock import FakeClock
from loadmaster.common.config import AliasSettings
from loadmaster.common.errors import UnavailableError
from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.auth import Authenticator
from loadmaster.gateway.catalog import ModelView
from loadmaster.gateway.frontends.openai import openai_routes
from loadmaster.gateway.generations import GenerationRouter, GenerationStreams
from loadmaster.gateway.ladders import Ladder, LadderRouter, alias_states, choose, ladders_from
from loadmaster.v1 import model_pool_pb2, scheduler_pb2

LADDER = Ladder("chat", ("big", "mid", "small"))
PINNED = Ladder("chat-big", ("big", "small"), pin_primary=True)


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ({"big": "READY", "mid": "READY", "small": "READY"}, "big"),  # the primary when READY
        ({"big": "IDLE", "mid": "IDLE", "small": "READY"}, "small"),  # a warm fallback when cold
        ({"big": "LOADING", "mid": "READY", "small": "READY"}, "mid"),  # loading is cold; in order
        ({"big": "IDLE", "mid": "LOADING", "small": "UNLOADING"}, "big"),  # none warm: load the primary
        ({}, "big"),  # nothing known
    ],
)
def test_choose_takes_the_primary_then_the_first_warm_fallback(states: dict[str, str], expected: str) -> None:
    assert choose(LADDER, states) == expected


def test_a_pinned_primary_takes_every_request_even_cold() -> None:
    assert choose(PINNED, {"big": "IDLE", "small": "READY"}) == "big"
    assert choose(PINNED, {"big": "READY", "small": "READY"}) == "big"


def test_ladders_from_settings_keep_the_order_and_the_pin() -> None:
    ladders = ladders_from({"chat": AliasSettings(models=["b", "a"], pin_primary=True)})
    assert ladders == {"chat": Ladder("chat", ("b", "a"), pin_primary=True)}
    assert ladders["chat"].primary == "b"


def test_alias_states_are_those_of_the_model_each_would_go_to() -> None:
    ladders = {"chat": LADDER, "chat-big": PINNED, "elsewhere": Ladder("elsewhere", ("x",))}
    states = {"big": "IDLE", "mid": "LOADING", "small": "READY"}
    assert alias_states(ladders, states) == {"chat": "READY", "chat-big": "IDLE"}


def test_skipped_fallbacks_are_passed_over_but_never_the_primary() -> None:
    cold = {"big": "IDLE", "mid": "READY", "small": "READY"}
    assert choose(LADDER, cold, skip={"mid"}) == "small"
    assert choose(LADDER, cold, skip={"mid", "small"}) == "big"  # the primary loads instead
    assert choose(LADDER, {"big": "READY", "mid": "READY"}, skip={"big"}) == "big"
    assert alias_states({"chat": LADDER}, {"big": "IDLE", "mid": "READY"}, skip={"mid"}) == {"chat": "IDLE"}


async def test_the_cloud_fallback_guard_is_asked_at_every_request() -> None:
    allowed = [True]
    states = {"big": "IDLE", "mid": "IDLE", "small": "READY"}
    router = LadderRouter(
        {"chat": LADDER},
        Fleet(states),
        clock=FakeClock(),
        remote=lambda: {"small"},
        allow_cloud_fallback=lambda: allowed[0],
    )
    assert await router.route("chat") == "small"
    allowed[0] = False  # as the admin API would switch it: no restart, no new router
    assert await router.route("chat") == "big"
    assert await router.route("small") == "small"  # a request naming the remote model is served
    allowed[0] = True
    assert await router.route("chat") == "small"


class Fleet:
    """The catalog's states, counting every look."""

    def __init__(self, states: dict[str, str]) -> None:
        self.states = states
        self.looks = 0
        self.fail: Exception | None = None
        self.gate: asyncio.Event | None = None

    async def __call__(self) -> Mapping[str, str]:
        self.looks += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return dict(self.states)


async def test_the_router_looks_at_most_once_per_max_age() -> None:
    clock, fleet = FakeClock(), Fleet({"big": "IDLE", "small": "READY"})
    router = LadderRouter({"chat": LADDER}, fleet, clock=clock, max_age_s=0.5)
    assert await router.route("chat") == "small"
    fleet.states["big"] = "READY"
    clock.advance(0.4)
    assert await router.route("chat") == "small" and fleet.looks == 1  # the last look is fresh enough
    clock.advance(0.1)
    assert await router.route("chat") == "big" and fleet.looks == 2
    assert await router.route("big") == "big" and await router.route("plain") == "plain"
    assert fleet.looks == 2  # a model's own name needs no look


async def test_a_fresh_observation_replaces_the_last_look() -> None:
    clock, fleet = FakeClock(), Fleet({"big": "IDLE", "small": "READY"})
    router = LadderRouter({"chat": LADDER}, fleet, clock=clock, max_age_s=10.0)
    assert await router.route("chat") == "small"
    router.observe({"big": "READY"})
    assert await router.route("chat") == "big" and fleet.looks == 1


async def test_concurrent_requests_share_one_look() -> None:
    fleet = Fleet({"big": "IDLE", "small": "READY"})
    fleet.gate = asyncio.Event()
    router = LadderRouter({"chat": LADDER}, fleet, clock=FakeClock())
    routes = [asyncio.ensure_future(router.route("chat")) for _ in range(5)]
    await asyncio.sleep(0)
    fleet.gate.set()
    assert await asyncio.gather(*routes) == ["small"] * 5
    assert fleet.looks == 1


async def test_without_the_catalog_requests_go_to_the_primary_and_it_is_not_asked_each_time() -> None:
    clock, fleet = FakeClock(), Fleet({"small": "READY"})
    fleet.fail = UnavailableError("scheduler unreachable")
    router = LadderRouter({"chat": LADDER}, fleet, clock=clock, max_age_s=0.5)
    assert await router.route("chat") == "big"
    assert await router.route("chat") == "big" and fleet.looks == 1
    fleet.fail = None
    clock.advance(0.5)
    assert await router.route("chat") == "small" and fleet.looks == 2


# ---- through the OpenAI routes and the real GenerationStreams ---------------------------------

ENDPOINT = "tcp://127.0.0.1:1"


class Scheduler:
    connected = True
    session = 1

    def __init__(self) -> None:
        self.enqueued: list[scheduler_pb2.RequestInfo] = []
        self.completed: list[str] = []

    def enqueue(self, request: scheduler_pb2.RequestInfo) -> None:
        self.enqueued.append(request)

    def complete(self, request_id: str, **_: Any) -> None:
        self.completed.append(request_id)

    def cancel(self, request_id: str) -> None:
        pass


class Workers:
    def send_generation(self, endpoint: str, kind: bytes, envelope: bytes) -> None:
        pass


def views(**states: str) -> dict[str, ModelView]:
    return {
        name: ModelView(name, state, backend="remote_openai" if name.startswith("cloud") else "transformers")
        for name, state in states.items()
    }


class Gateway:
    """The OpenAI routes over a `GenerationRouter` whose catalog says `self.fleet`."""

    def __init__(self, **states: str) -> None:
        self.fleet = views(**states)
        self.scheduler = Scheduler()
        self.streams = GenerationStreams(
            scheduler=self.scheduler, workers=Workers(), telemetry=TelemetryReporter("gateway", "t", None)
        )

        async def catalog() -> dict[str, ModelView]:
            return self.fleet

        ladders = {
            "chat": Ladder("chat", ("tiny-b", "tiny")),
            "chat-b": Ladder("chat-b", ("tiny-b", "tiny"), True),
        }
        if "cloud" in states:  # a remote rung: the models named cloud* are remote_openai
            ladders["chat-3"] = Ladder("chat-3", ("tiny-b", "tiny", "cloud"))
            ladders["cloud-first"] = Ladder("cloud-first", ("cloud", "tiny"))
        self.allow_cloud_fallback = True
        self.port = GenerationRouter(
            self.streams,
            catalog,
            ladders=ladders,
            clock=FakeClock(),
            allow_cloud_fallback=lambda: self.allow_cloud_fallback,
        )
        app = Starlette(routes=openai_routes(self.port, Authenticator([]), gateway_id="gw"))
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
        self.client = openai.AsyncOpenAI(
            base_url="http://gateway/v1", api_key="k", http_client=http, max_retries=0
        )

    async def answer(self, *pieces: str) -> str:
        """Grant the next queued generation and answer it with `pieces`; returns its model."""
        for _ in range(200):  # bounded: the request reaches the scheduler within a few loop turns
            if len(self.scheduler.enqueued) > len(self.scheduler.completed):
                break
            await asyncio.sleep(0.005)
        info = self.scheduler.enqueued[len(self.scheduler.completed)]
        self.streams.on_grant(
            scheduler_pb2.Grant(request_id=info.request_id, worker_id="w1", data_endpoint=ENDPOINT)
        )
        out = model_pool_pb2.GenerateReplies()
        for sequence, piece in enumerate(pieces):
            reply = out.replies.add(
                request_id=info.request_id, model_id=info.model_id, sequence=sequence, worker_id="w1"
            )
            reply.chunk.text = piece
        end = out.replies.add(
            request_id=info.request_id, model_id=info.model_id, sequence=len(pieces), worker_id="w1"
        )
        end.result.finish_reason = model_pool_pb2.FINISH_REASON_STOP
        end.result.usage.prompt_tokens, end.result.usage.completion_tokens = 3, len(pieces)
        self.streams.on_replies(ENDPOINT, out)
        return info.model_id


MESSAGES: Any = [{"role": "user", "content": "hi"}]


async def test_an_alias_is_answered_by_the_warm_fallback_named_in_model_and_header() -> None:
    gateway = Gateway(**{"tiny-b": "IDLE", "tiny": "READY"})
    call = asyncio.ensure_future(
        gateway.client.chat.completions.with_raw_response.create(model="chat", messages=MESSAGES)
    )
    assert await gateway.answer("hel", "lo") == "tiny"  # queued for the warm fallback
    raw = await call
    reply = raw.parse()
    assert reply.model == "tiny" and raw.headers["x-loadmaster-model"] == "tiny"
    assert reply.choices[0].message.content == "hello"


async def test_a_pinned_alias_waits_for_its_cold_primary() -> None:
    gateway = Gateway(**{"tiny-b": "IDLE", "tiny": "READY"})
    call = asyncio.ensure_future(
        gateway.client.completions.with_raw_response.create(model="chat-b", prompt="once")
    )
    assert await gateway.answer("x") == "tiny-b"
    raw = await call
    assert raw.parse().model == "tiny-b" and raw.headers["x-loadmaster-model"] == "tiny-b"


async def test_every_chunk_of_an_alias_stream_names_the_model_that_answered() -> None:
    gateway = Gateway(**{"tiny-b": "READY", "tiny": "READY"})

    async def read() -> tuple[str, list[str], str]:
        raw = await gateway.client.chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES, stream=True
        )
        chunks = [chunk async for chunk in raw.parse()]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return raw.headers["x-loadmaster-model"], [c.model for c in chunks], text

    call = asyncio.ensure_future(read())
    assert await gateway.answer("a", "b", "c") == "tiny-b"  # the primary is READY
    header, models, text = await call
    assert header == "tiny-b" and set(models) == {"tiny-b"} and len(models) >= 3 and text == "abc"


async def test_the_model_list_has_the_aliases_with_the_state_of_their_choice() -> None:
    gateway = Gateway(**{"tiny-b": "IDLE", "tiny": "READY"})
    listed = {m.id: (m.model_extra or {})["x_state"] for m in (await gateway.client.models.list()).data}
    assert listed == {"tiny-b": "IDLE", "tiny": "READY", "chat": "READY", "chat-b": "IDLE"}
    assert (await gateway.client.models.retrieve("chat")).id == "chat"
    gateway.fleet = views(**{"tiny-b": "READY", "tiny": "READY"})
    await gateway.client.models.list()  # a fresh look routes the next request at once
    call = asyncio.ensure_future(gateway.client.completions.create(model="chat", prompt="p"))
    assert await gateway.answer("y") == "tiny-b"
    assert (await call).model == "tiny-b"


async def test_a_remote_fallback_is_skipped_while_cloud_fallback_is_off() -> None:
    gateway = Gateway(**{"tiny-b": "IDLE", "tiny": "IDLE", "cloud": "READY"})

    async def served(model: str) -> str:
        call = asyncio.ensure_future(gateway.client.chat.completions.create(model=model, messages=MESSAGES))
        queued_for = await gateway.answer("x")
        assert (await call).model == queued_for
        return queued_for

    assert await served("chat-3") == "cloud"  # allowed: the warm remote rung answers
    gateway.allow_cloud_fallback = False
    assert await served("chat-3") == "tiny-b"  # skipped: the cold primary loads instead
    assert await served("cloud-first") == "cloud"  # a remote primary is always served
    assert await served("cloud") == "cloud"  # and so is a request naming the remote model
    listed = {m.id: m.x_state for m in (await gateway.client.models.list()).data}  # type: ignore[attr-defined]
    assert listed["chat-3"] == "IDLE" and listed["cloud"] == "READY"  # the remote rung is listed
    gateway.fleet = views(**{"tiny-b": "IDLE", "tiny": "READY", "cloud": "READY"})
    await gateway.client.models.list()  # a fresh look
    assert await served("chat-3") == "tiny"  # a local fallback is still taken
