"""The pure parts of the openai_process backend: the command template, the engine's
environment, its config, the OpenAI request body, SSE chunks -> stream events, and the
backoff after repeated crashes. (The real engine process: tests/integration.)"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.crash_backoff import CrashBackoff
from loadmaster.model_pool.engines import engine_class
from loadmaster.model_pool.engines._proxy_streams import ProxyStream, openai_response_format, request_body
from loadmaster.model_pool.engines.engine_process import engine_env, gpus_of, render_command
from loadmaster.model_pool.engines.openai_process import OpenAIProcessEngine
from loadmaster.model_pool.generation import (
    ChatMessage,
    FinishReason,
    GenerationEnd,
    GenerationRequest,
    SamplingParams,
    TokenChunk,
)
from loadmaster.model_pool.repository import ModelConfigError, ModelRepository, OpenAIProcessModelConfig

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


# ---- the command and its environment ------------------------------------------------------


def test_the_command_template_is_filled_in_and_split_like_a_shell() -> None:
    argv = render_command(
        "vllm serve '{model_path}' --host {host} --port {port} --tensor-parallel-size {num_gpus} --gpus={gpus}",
        model_path="/models/my llama",
        port=18001,
        host="127.0.0.1",
        gpus=(1, 3),
    )
    assert argv == [
        "vllm", "serve", "/models/my llama", "--host", "127.0.0.1", "--port", "18001",
        "--tensor-parallel-size", "2", "--gpus=1,3",
    ]  # fmt: skip
    listed = render_command(
        ["llama-server", "-m", "{model_path}", "--port", "{port}", "-ngl", "99"],
        model_path="m.gguf",
        port=9,
        host="h",
        gpus=(),
    )
    assert listed == ["llama-server", "-m", "m.gguf", "--port", "9", "-ngl", "99"]


def test_an_unknown_placeholder_is_a_config_error_naming_it() -> None:
    with pytest.raises(ModelConfigError, match=r"'--model={path}' has an unknown placeholder 'path'"):
        render_command("serve --model={path}", model_path="m", port=1, host="h", gpus=())


def test_the_engine_sees_the_lease_gpus_or_none() -> None:
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "LOADMASTER_INTERNAL_AUTH__SECRET_FILE": "/s"}
    env = engine_env(base, gpus=(2, 3), extra={"A": "1"})
    assert not any(key.startswith("LOADMASTER_") for key in env)  # the worker's settings stay its own
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # NVML's order: index N is the broker's GPU N
    assert env["PATH"] == "/bin" and env["A"] == "1"
    assert engine_env({"CUDA_VISIBLE_DEVICES": "0"}, gpus=None)["CUDA_VISIBLE_DEVICES"] == ""
    assert gpus_of("cuda:1", [1]) == (1,)
    assert gpus_of("cuda", [3, 2]) == (2, 3)  # a split lease: every GPU of it
    assert gpus_of("cpu", [0]) is None


# ---- config ----------------------------------------------------------------------------------


def test_the_example_parses_and_its_lease_is_what_it_says(tmp_path: Path) -> None:
    spec = ModelRepository(EXAMPLES / "models").spec("tiny-chat-process")
    assert isinstance(spec.config, OpenAIProcessModelConfig)
    assert "{model_path}" in str(spec.config.command) and "{port}" in str(spec.config.command)
    assert engine_class("openai_process") is OpenAIProcessEngine
    assert spec.config.vram_mb == 64


def _spec(root: Path, config: str) -> object:
    (root / "m").mkdir(exist_ok=True)
    (root / "m" / "config.yaml").write_text(config)
    return ModelRepository(root).spec("m")


def test_bad_configs_are_refused_with_the_field(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="command: Value error, command is empty"):
        _spec(tmp_path, "backend: openai_process\ncommand: '  '\n")
    with pytest.raises(ModelConfigError, match="instances: Value error, an engine process is one instance"):
        _spec(tmp_path, "backend: openai_process\ncommand: serve\ninstances: 2\n")


def test_the_estimate_comes_from_the_weight_files(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.gguf").write_bytes(b"\0" * (10 << 20))
    spec = _spec(
        tmp_path, "backend: openai_process\ncommand: serve {model_path}\npath: ../weights/model.gguf\n"
    )
    assert OpenAIProcessEngine.estimate_mb(spec) == 13  # 10 MB x 1.3  # type: ignore[arg-type]
    empty = _spec(tmp_path, "backend: openai_process\ncommand: serve\npath: .\n")
    with pytest.raises(ModelConfigError, match="no weight files"):
        OpenAIProcessEngine.estimate_mb(empty)  # type: ignore[arg-type]


# ---- the request body --------------------------------------------------------------------------


def test_chat_goes_to_chat_completions_and_prompts_to_completions() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, top_p=0.5, seed=7, stop=("\n",))
    chat = GenerationRequest("r", params, messages=(ChatMessage("user", "hi"),))
    path, body = request_body(chat, model="served", response_format={"type": "json_object"})
    assert path == "/v1/chat/completions"
    assert body == {
        "model": "served",
        "max_tokens": 8,
        "temperature": 0.0,
        "top_p": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": 7,
        "stop": ["\n"],
        "response_format": {"type": "json_object"},
        "messages": [{"role": "user", "content": "hi"}],
    }
    path, body = request_body(GenerationRequest("r", SamplingParams(max_tokens=2), prompt="x"), model="m")
    assert path == "/v1/completions" and body["prompt"] == "x"
    assert "seed" not in body and "stop" not in body and "response_format" not in body
    ids = GenerationRequest("r", SamplingParams(max_tokens=2), prompt_token_ids=(1, 2))
    assert request_body(ids, model="m")[1]["prompt"] == [1, 2]


@dataclass(frozen=True, slots=True)
class _Format:  # the shape of the domain ResponseFormat (generation.py, issue 22)
    kind: str
    schema: str = ""
    name: str = ""


def test_response_format_passes_through_in_openais_shape() -> None:
    assert openai_response_format(None) is None
    assert openai_response_format(_Format("json_object")) == {"type": "json_object"}
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    assert openai_response_format(_Format("json_schema", schema, "thing")) == {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": json.loads(schema)},
    }
    assert openai_response_format(_Format("json_schema", "{}"))["json_schema"]["name"] == "response"  # type: ignore[index]
    with pytest.raises(InvalidArgumentError, match=r"response_format\.json_schema\.schema: not JSON"):
        openai_response_format(_Format("json_schema", "{nope"))


# ---- SSE chunks -> events ---------------------------------------------------------------------


def _drain(stream: ProxyStream) -> list[object]:
    out = []
    while not stream.events.empty():
        out.append(stream.events.get_nowait())
    return out


def _delta(text: str | None = None, finish: str | None = None, usage: dict[str, int] | None = None) -> dict:
    choice: dict[str, object] = {"index": 0, "delta": {} if text is None else {"content": text}}
    if finish:
        choice["finish_reason"] = finish
    chunk: dict[str, object] = {"choices": [choice]}
    if usage:
        chunk["usage"] = usage
    return chunk


async def test_chunks_become_numbered_events_then_one_terminal_with_the_engines_usage() -> None:
    done: list[ProxyStream] = []
    stream = ProxyStream("r", (), done.append)
    assert not stream.feed({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    assert not stream.feed(_delta("Hel"))
    assert not stream.feed(_delta("lo"))
    assert not stream.feed(_delta(finish="length", usage={"prompt_tokens": 3, "completion_tokens": 2}))
    stream.finished()
    events = _drain(stream)
    assert events[:2] == [TokenChunk("r", 0, (), "Hel"), TokenChunk("r", 1, (), "lo")]
    end = events[2]
    assert isinstance(end, GenerationEnd) and end.sequence == 2
    assert end.finish_reason is FinishReason.LENGTH and end.usage.prompt_tokens == 3
    assert end.usage.completion_tokens == 2 and done == [stream]
    stream.end(FinishReason.ERROR, "late")  # nothing after the terminal
    assert _drain(stream) == []


async def test_a_stop_string_is_honoured_even_when_the_engine_ignores_it() -> None:
    stream = ProxyStream("r", ("END",), lambda _: None)
    assert not stream.feed({"choices": [{"index": 0, "text": "abcE"}]})  # completions chunks
    assert stream.feed({"choices": [{"index": 0, "text": "NDmore"}]})
    events = _drain(stream)
    assert "".join(e.text for e in events if isinstance(e, TokenChunk)) == "abc"
    assert isinstance(events[-1], GenerationEnd) and events[-1].finish_reason is FinishReason.STOP


async def test_an_error_chunk_or_a_stream_without_finish_ends_in_error() -> None:
    failed = ProxyStream("r", (), lambda _: None)
    assert failed.feed({"error": {"message": "out of memory"}})
    end = _drain(failed)[-1]
    assert isinstance(end, GenerationEnd) and end.finish_reason is FinishReason.ERROR
    assert "out of memory" in end.error
    cut = ProxyStream("r", (), lambda _: None)
    cut.feed(_delta("x"))
    cut.finished()
    end = _drain(cut)[-1]
    assert isinstance(end, GenerationEnd) and "without a finish_reason" in end.error
    await asyncio.sleep(0)


# ---- crash backoff -------------------------------------------------------------------------------


def test_repeated_crashes_back_off_doubling_and_are_forgotten_after_the_window() -> None:
    backoff = CrashBackoff(first_s=1.0, max_s=5.0, window_s=100.0)
    delays = [backoff.crashed("m", now=t) for t in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]  # the first reloads at once; capped at max_s
    assert backoff.crashed("other", now=5.0) == 0.0  # per model
    assert backoff.crashes("m", now=50.0) == 6
    assert backoff.crashed("m", now=200.0) == 0.0  # the old ones left the window
    assert backoff.crashes("m", now=200.0) == 1


def test_the_priority_travels_only_to_engines_that_take_one() -> None:
    request = dataclasses.replace(
        GenerationRequest("r", SamplingParams(max_tokens=2), prompt="x"), priority=0
    )
    assert "priority" not in request_body(request, model="m")[1]
    assert request_body(request, model="m", forward_priority=True)[1]["priority"] == 0


def test_chat_template_kwargs_are_sent_to_the_server_only_when_given() -> None:
    messages = (ChatMessage("user", "hi"),)
    plain = GenerationRequest("r", SamplingParams(max_tokens=2), messages=messages)
    assert "chat_template_kwargs" not in request_body(plain, model="m")[1]  # some servers refuse the field
    asked = GenerationRequest(
        "r", SamplingParams(max_tokens=2), messages=messages, chat_template_kwargs={"enable_thinking": False}
    )
    assert request_body(asked, model="m")[1]["chat_template_kwargs"] == {"enable_thinking": False}


def test_what_the_proxy_does_not_carry_is_refused_by_name() -> None:
    from loadmaster.model_pool.engines._openai_proxy import refuse_unproxied
    from loadmaster.model_pool.generation import ChatMessage, FunctionTool, ToolUse

    params = SamplingParams(max_tokens=4)
    chat = (ChatMessage("user", "hi"),)
    refuse_unproxied(GenerationRequest("ok", params, messages=chat), "m")  # nothing extra: fine
    for request, field in (
        (GenerationRequest("t", params, messages=chat, tools=ToolUse((FunctionTool("f"),))), "tools"),
        (GenerationRequest("l", params, messages=chat, logprobs=1), "logprobs"),
        (GenerationRequest("n", params, messages=chat, n=2), "n"),
    ):
        with pytest.raises(
            InvalidArgumentError, match=f"^{field}: model 'm' is served through an OpenAI-compatible server"
        ):
            refuse_unproxied(request, "m")
