"""Generation streams at the wire: proto <-> domain, and the order/exactly-once checker."""

from __future__ import annotations

import pytest

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.generation import FinishReason, GenerationEnd, ResponseFormat, TokenChunk, Usage
from loadmaster.model_pool.generation_wire import (
    StreamOrder,
    StreamOrderError,
    reply_to_proto,
    request_from_proto,
)
from loadmaster.v1 import errors_pb2, model_pool_pb2


def test_request_from_proto_defaults_and_fields() -> None:
    message = model_pool_pb2.GenerateRequest(
        request_id="r",
        model_id="tiny-chat",
        messages=model_pool_pb2.ChatMessages(
            messages=[model_pool_pb2.ChatMessage(role="user", content="hi")]
        ),
        sampling=model_pool_pb2.SamplingParams(max_tokens=5, stop=["\n"]),
    )
    request = request_from_proto(message)
    assert request.messages is not None and request.messages[0].content == "hi"
    assert (request.params.temperature, request.params.top_p, request.params.seed) == (1.0, 1.0, None)
    assert request.params.stop == ("\n",)
    message.sampling.temperature = 0.0  # set to zero is greedy, not "unset"
    message.sampling.seed = 7
    assert request_from_proto(message).params.greedy
    assert request_from_proto(message).params.seed == 7


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (model_pool_pb2.GenerateRequest(request_id="r", prompt_text="x"), "max_tokens"),
        (
            model_pool_pb2.GenerateRequest(
                request_id="r", sampling=model_pool_pb2.SamplingParams(max_tokens=1)
            ),
            "one of",
        ),
        (
            model_pool_pb2.GenerateRequest(
                request_id="r",
                prompt_text="x",
                sampling=model_pool_pb2.SamplingParams(max_tokens=1, top_p=0.0),
            ),
            "top_p",
        ),
    ],
)
def test_bad_requests_name_the_field(message: model_pool_pb2.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        request_from_proto(message)


def test_replies_in_order_then_one_terminal() -> None:
    events = [
        TokenChunk("r", 0, (5, 6), "ab"),
        TokenChunk("r", 1, (7,), "c"),
        GenerationEnd("r", 2, FinishReason.LENGTH, Usage(3, 3)),
    ]
    replies = [reply_to_proto(e, model_id="m", worker_id="w") for e in events]
    assert [r.WhichOneof("kind") for r in replies] == ["chunk", "chunk", "result"]
    assert replies[2].result.finish_reason == model_pool_pb2.FINISH_REASON_LENGTH
    assert replies[2].result.usage.completion_tokens == 3
    order = StreamOrder()
    assert [order.accept(r) for r in replies] == [False, False, True]
    with pytest.raises(StreamOrderError, match="after the terminal"):
        order.accept(replies[2])


@pytest.mark.parametrize(
    ("sequences", "message"), [([0, 0], "repeated"), ([0, 2], "missing"), ([1], "missing")]
)
def test_gaps_and_repeats_are_caught(sequences: list[int], message: str) -> None:
    order = StreamOrder()
    with pytest.raises(StreamOrderError, match=message):
        for sequence in sequences:
            order.accept(reply_to_proto(TokenChunk("r", sequence, (1,), "x"), model_id="m"))


def test_cancelled_and_error_terminals() -> None:
    cancelled = reply_to_proto(GenerationEnd("r", 4, FinishReason.CANCELLED, Usage(2, 4)), model_id="m")
    assert cancelled.WhichOneof("kind") == "cancelled" and cancelled.cancelled.usage.completion_tokens == 4
    late = GenerationEnd("r", 3, FinishReason.ERROR, Usage(2, 3), error="the model was unloaded")
    early = GenerationEnd("r", 0, FinishReason.ERROR, Usage(2, 0), error="the model was unloaded")
    late_reply = reply_to_proto(
        late, model_id="m", error_code=errors_pb2.ERROR_CODE_UNAVAILABLE, retryable=True
    )
    early_reply = reply_to_proto(
        early, model_id="m", error_code=errors_pb2.ERROR_CODE_UNAVAILABLE, retryable=True
    )
    assert late_reply.error.error_code == errors_pb2.ERROR_CODE_UNAVAILABLE
    assert "unloaded" in late_reply.error.error_message
    assert (late_reply.error.retryable, early_reply.error.retryable) == (False, True)  # not after tokens


def test_response_format_comes_through_and_text_means_none() -> None:
    message = model_pool_pb2.GenerateRequest(
        request_id="r", prompt_text="x", sampling=model_pool_pb2.SamplingParams(max_tokens=5)
    )
    assert request_from_proto(message).response_format is None
    message.response_format.type = "text"
    assert request_from_proto(message).response_format is None
    message.response_format.type = "json_schema"
    message.response_format.json_schema = '{"type": "integer"}'
    message.response_format.name = "n"
    assert request_from_proto(message).response_format == ResponseFormat(
        kind="json_schema", schema='{"type": "integer"}', name="n"
    )
    message.response_format.type = "json_object"
    assert request_from_proto(message).response_format == ResponseFormat(
        kind="json_object", schema='{"type": "integer"}', name="n"
    )


@pytest.mark.parametrize(
    ("kind", "schema", "words"),
    [("yaml", "", "response_format.type: 'yaml'"), ("json_schema", "", "json_schema.schema: missing")],
)
def test_a_bad_response_format_names_the_field(kind: str, schema: str, words: str) -> None:
    message = model_pool_pb2.GenerateRequest(
        request_id="r",
        prompt_text="x",
        sampling=model_pool_pb2.SamplingParams(max_tokens=5),
        response_format=model_pool_pb2.ResponseFormat(type=kind, json_schema=schema),
    )
    with pytest.raises(InvalidArgumentError, match=words):
        request_from_proto(message)


def test_a_wire_response_format_reaches_engine_processes_in_openais_shape() -> None:
    """The worker's domain value is what the engine-process pass-through reads."""
    from loadmaster.model_pool.engines._proxy_streams import openai_response_format

    message = model_pool_pb2.GenerateRequest(
        request_id="r",
        prompt_text="x",
        sampling=model_pool_pb2.SamplingParams(max_tokens=5),
        response_format=model_pool_pb2.ResponseFormat(
            type="json_schema", json_schema='{"type":"integer"}', name="n"
        ),
    )
    assert openai_response_format(request_from_proto(message).response_format) == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "integer"}},
    }


def test_progress_replies_stand_outside_the_order_and_only_before_the_first_chunk() -> None:
    order = StreamOrder()
    progress = model_pool_pb2.GenerateReply(request_id="r")
    progress.progress.queued_ahead = 3
    assert order.accept(progress) is False and order.accept(progress) is False
    chunk = reply_to_proto(TokenChunk("r", 0, (1,), "a"), model_id="m")
    assert order.accept(chunk) is False
    with pytest.raises(StreamOrderError, match="progress after the stream began"):
        order.accept(progress)


def test_priority_tenant_and_weight_reach_the_engine() -> None:
    message = model_pool_pb2.GenerateRequest(
        request_id="r",
        model_id="m",
        prompt_text="hi",
        sampling=model_pool_pb2.SamplingParams(max_tokens=2),
        priority=2,
        tenant="acme",
        tenant_weight=2.5,
    )
    request = request_from_proto(message)
    assert (request.priority, request.tenant, request.tenant_weight) == (2, "acme", 2.5)
    message.tenant_weight = 0.0  # unset
    assert request_from_proto(message).tenant_weight == 1.0


def test_chat_template_kwargs_come_through_as_an_object_or_are_refused_naming_the_field() -> None:
    chat = model_pool_pb2.ChatMessages(messages=[model_pool_pb2.ChatMessage(role="user", content="hi")])
    sampling = model_pool_pb2.SamplingParams(max_tokens=1)
    message = model_pool_pb2.GenerateRequest(
        request_id="r", messages=chat, sampling=sampling, chat_template_kwargs='{"enable_thinking":false}'
    )
    assert request_from_proto(message).chat_template_kwargs == {"enable_thinking": False}
    message.chat_template_kwargs = ""
    assert request_from_proto(message).chat_template_kwargs is None
    for bad, words in (("[1]", "a JSON object"), ("{", "not JSON")):
        message.chat_template_kwargs = bad
        with pytest.raises(InvalidArgumentError, match=f"chat_template_kwargs: {words}"):
            request_from_proto(message)
    text = model_pool_pb2.GenerateRequest(
        request_id="t", prompt_text="x", sampling=sampling, chat_template_kwargs='{"a":1}'
    )
    with pytest.raises(InvalidArgumentError, match="chat_template_kwargs: only chat messages"):
        request_from_proto(text)
