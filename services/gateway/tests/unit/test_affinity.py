"""The prefix-affinity key the gateway puts on a generation's RequestInfo: equal for prompts
that share their first PREFIX_CHARS characters, absent for short prompts, and on the
scheduler's RequestInfo when a generation is queued."""

from __future__ import annotations

import asyncio
import json

from loadmaster.common.telemetry import TelemetryReporter
from loadmaster.gateway.affinity import PREFIX_CHARS, prefix_affinity_key
from loadmaster.gateway.frontends.openai_schema import parse_chat, parse_completion
from loadmaster.gateway.generations import GenerationStreams
from loadmaster.v1 import scheduler_pb2


class _Scheduler:
    """Records what is queued (the session's other calls are not reached here)."""

    connected = True
    session = 1

    def __init__(self) -> None:
        self.enqueued: list[scheduler_pb2.RequestInfo] = []

    def enqueue(self, request: scheduler_pb2.RequestInfo) -> None:
        self.enqueued.append(request)

    def cancel(self, request_id: str) -> None:
        pass


class _Workers:
    def send_generation(self, endpoint: str, kind: bytes, envelope: bytes) -> None:
        pass


SYSTEM = "You are the fleet assistant. " * 20  # ~580 characters


def chat(system: str, user: str, *, model: str = "tiny-chat", role: str = "system") -> bytes:
    messages = [{"role": role, "content": system}, {"role": "user", "content": user}]
    return json.dumps({"model": model, "messages": messages}).encode()


def test_chats_sharing_a_system_prompt_share_a_key_and_others_do_not() -> None:
    first = prefix_affinity_key(parse_chat(chat(SYSTEM, "where is robot 3?")))
    assert first and len(first) == 16
    assert prefix_affinity_key(parse_chat(chat(SYSTEM, "and robot 4?"))) == first
    assert prefix_affinity_key(parse_chat(chat(SYSTEM, "x", role="developer"))) == first  # sent as system
    assert prefix_affinity_key(parse_chat(chat("Another prompt. " * 30, "where is robot 3?"))) != first
    assert prefix_affinity_key(parse_chat(chat(SYSTEM, "where is robot 3?", model="other"))) != first


def test_short_prompts_get_no_key_and_text_prompts_hash_their_start() -> None:
    assert prefix_affinity_key(parse_chat(chat("be brief", "hi"))) == ""
    short = json.dumps({"model": "m", "prompt": "a" * (PREFIX_CHARS - 1)}).encode()
    assert prefix_affinity_key(parse_completion(short)) == ""
    long_a = json.dumps({"model": "m", "prompt": "a" * PREFIX_CHARS + "tail one"}).encode()
    long_b = json.dumps({"model": "m", "prompt": "a" * PREFIX_CHARS + "tail two"}).encode()
    assert (
        prefix_affinity_key(parse_completion(long_a)) == prefix_affinity_key(parse_completion(long_b)) != ""
    )


def test_a_queued_generation_carries_its_key_to_the_scheduler() -> None:
    async def run() -> None:
        scheduler = _Scheduler()
        streams = GenerationStreams(
            scheduler=scheduler, workers=_Workers(), telemetry=TelemetryReporter("gateway", "test", None)
        )
        request = parse_chat(chat(SYSTEM, "where is robot 3?"))
        events = streams.generate(request, request_id="g1", client_id="arm")
        pending = asyncio.ensure_future(anext(events))
        for _ in range(5):
            await asyncio.sleep(0)
        [info] = scheduler.enqueued
        assert info.affinity_key == prefix_affinity_key(request) != ""
        pending.cancel()

    asyncio.run(run())
