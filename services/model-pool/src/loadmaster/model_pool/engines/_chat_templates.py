"""A model's chat template and the variables it is rendered with (docs/generative.md).

    template = chat_template(spec)          # the config's `chat_template` (file or inline), or None
    kwargs = template_kwargs(config, request)   # `enable_thinking` from the config, then the
                                                # request's `chat_template_kwargs` over it

Pure: file reads only, no torch, so the worker and its tests use it without an engine.
"""

from __future__ import annotations

from typing import Any

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.generation import GenerationRequest
from loadmaster.model_pool.repository import ModelConfigError, ModelSpec, TransformersModelConfig

__all__ = ["chat_template", "template_kwargs"]

MAX_TEMPLATE_BYTES = 1 << 20
# Arguments of `apply_chat_template` and variables it sets itself: never a request's to give.
RESERVED = frozenset(
    {
        "messages",
        "conversation",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "documents",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_tensors",
        "bos_token",
        "eos_token",
        "padding",
        "truncation",
        "max_length",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _is_inline(value: str) -> bool:
    return "{{" in value or "{%" in value


def chat_template(spec: ModelSpec) -> str | None:
    """The template the config gives: inline text as is, a file name read from the model folder."""
    config = spec.config
    assert isinstance(config, TransformersModelConfig)
    value = config.chat_template
    if value is None or _is_inline(value):
        return value
    path = spec.path(value)
    try:
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ModelConfigError(f"model '{spec.model_id}': chat_template {path} is over 1 MiB")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ModelConfigError(
            f"model '{spec.model_id}': chat_template: cannot read {path} ({error}); give a file in the "
            "model folder or the template itself"
        ) from None


def template_kwargs(config: TransformersModelConfig, request: GenerationRequest) -> dict[str, Any]:
    """The variables a chat is rendered with besides its messages."""
    kwargs: dict[str, Any] = {}
    if config.thinking is not None:
        kwargs["enable_thinking"] = config.thinking
    if request.chat_template_kwargs:
        reserved = sorted(set(request.chat_template_kwargs) & RESERVED)
        if reserved:
            raise InvalidArgumentError(
                f"chat_template_kwargs.{reserved[0]}: set by the server, not by a request"
            )
        kwargs.update(request.chat_template_kwargs)
    return kwargs
