"""A chat template from the model's config and the thinking switch, through the real suite with
the official `openai` client. `tiny-think` is tiny-chat's weights and tokenizer in a folder with
no chat template; its config.yaml names one (chat_template.jinja) that puts an empty
`<think></think>` block after the assistant's marker when `enable_thinking` is false, and says
`thinking: false`. So the prompt the model reads, and its token count in `usage`, shows which
way the switch went: the model's default, or the request's `chat_template_kwargs`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from loadmaster.cli.launcher import Suite

# Slow (make test-all): a suite of its own, 5 s; services/model-pool/tests/unit/
# test_chat_templates.py checks the template, thinking and the refused arguments.
pytestmark = pytest.mark.slow

MODEL = "tiny-think"
ARTIFACTS = Path(__file__).resolve().parents[2] / "examples" / "models" / MODEL / "artifacts"
MESSAGES: Any = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def client(suite: Suite) -> openai.OpenAI:
    gateway = suite.settings.gateway
    return openai.OpenAI(
        base_url=f"http://{gateway.http_host}:{gateway.http_port}/v1",
        api_key="none",
        max_retries=0,
        timeout=120,
    )


def prompt_tokens(client: openai.OpenAI, **kwargs: Any) -> int:
    extra = {"chat_template_kwargs": kwargs} if kwargs else None
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0, extra_body=extra
    )
    assert reply.model == MODEL and reply.usage is not None and reply.usage.completion_tokens == 2
    return reply.usage.prompt_tokens


def test_the_configs_template_and_thinking_default_apply_and_a_request_switches_thinking(
    client: openai.OpenAI,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(ARTIFACTS, local_files_only=True)
    assert not tokenizer.chat_template  # the folder has none: the answer below used the config's
    off = prompt_tokens(client)  # a cold load first
    on = prompt_tokens(client, enable_thinking=True)
    think_block = len(tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert off - on == think_block > 0
    assert prompt_tokens(client, enable_thinking=False) == off
    reference = len(tokenizer.encode("<s><|user|>hello</s><|assistant|>", add_special_tokens=False))
    assert on == reference  # exactly the config's template, thinking on


def test_template_arguments_a_request_may_not_set_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"messages": []}},
        )
    assert caught.value.param == "chat_template_kwargs"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=MODEL,
            prompt="hello",
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
    assert caught.value.param == "chat_template_kwargs"
