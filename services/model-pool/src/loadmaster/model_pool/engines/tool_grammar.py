"""Forced tool calls: `tool_choice` `required` or a named function, enforced while decoding.

The reply is constrained to tool calls written in the model's own `tool_format`, so the
same parser that reads an `auto` reply (loadmaster.model_pool.tool_calls) reads this one,
and every call's `arguments` is valid against its function's `parameters`: each call is an
llguidance JSON Schema grammar (`{"name": <const>, "arguments": <parameters>}`), embedded in
a Lark grammar for the format's framing:

    hermes   <tool_call>\\n{call}\\n</tool_call>   (joined by "\\n" when parallel)
    llama    {call}                                (joined by "; ", key "parameters")
    mistral  [{call}, ...]                         (the bare array: `[TOOL_CALLS]` is a special
                                                    token in Mistral's tokenizers, written as
                                                    text it would be other tokens)

`parallel_tool_calls: false` allows exactly one call, after which only end-of-sequence is
allowed; with it on, 1..MAX_PARALLEL_CALLS calls. `required` allows any offered function,
a named `tool_choice` only that one. JSON is compact (no free whitespace), as structured
output's (engines/grammar.py), whose `Constraint`, `GrammarMask` and tokenizer this reuses:
the compiled grammar becomes a `grammar.Constraint` like a response format's. A function
whose schema llguidance cannot compile is an `InvalidArgumentError` naming
`tools[i].function.parameters`.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import llguidance

from loadmaster.common.errors import InvalidArgumentError
from loadmaster.model_pool.engines import grammar
from loadmaster.model_pool.generation import FunctionTool, ToolUse
from loadmaster.model_pool.tool_calls import HERMES_CLOSE, HERMES_OPEN, ToolFormat

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["MAX_PARALLEL_CALLS", "tool_constraint", "tool_grammar"]

MAX_PARALLEL_CALLS = 8  # calls in one constrained reply when parallel_tool_calls is on
_COMPACT: JsonCompileOptions = {"whitespace_flexible": False}


def _call_schema(function: FunctionTool, *, arguments_key: str, where: str) -> dict[str, Any]:
    try:
        parameters = function.schema()
    except ValueError as error:
        raise InvalidArgumentError(f"{where}: {error}") from None
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        "x-guidance": dict(_COMPACT),
    }


def _literal(text: str) -> str:
    return json.dumps(text)  # a JSON string is a Lark string literal


def tool_grammar(tools: ToolUse, format: ToolFormat) -> str:
    """The Lark grammar (llguidance's dialect) of a constrained reply to `tools`."""
    arguments_key = "parameters" if format is ToolFormat.LLAMA else "arguments"
    index_of = {function.name: index for index, function in enumerate(tools.functions)}
    called = tools.called()
    if not called:
        raise InvalidArgumentError(f"tool_choice: function {tools.function_name!r} is not one of the tools")
    rules = []
    for number, function in enumerate(called):
        where = f"tools[{index_of[function.name]}].function.parameters"
        schema = _call_schema(function, arguments_key=arguments_key, where=where)
        rules.append(f"call_{number}: %json {json.dumps(schema, separators=(',', ':'))}")
    alternatives = " | ".join(f"call_{number}" for number in range(len(called)))
    if format is ToolFormat.HERMES:
        one = f"{_literal(HERMES_OPEN + chr(10))} body {_literal(chr(10) + HERMES_CLOSE)}"
        separator = _literal("\n")
    else:
        one = "body"
        separator = _literal("; " if format is ToolFormat.LLAMA else ",")
    more = f" ({separator} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if tools.parallel else ""
    start = f"call{more}"
    if format is ToolFormat.MISTRAL:
        start = f'"[" {start} "]"'
    lines = [f"start: {start}", f"call: {one}", f"body: {alternatives}", *rules]
    return "\n".join(lines) + "\n"


def tool_constraint(
    grammars: grammar.JsonGrammars,
    tools: ToolUse,
    format: ToolFormat,
    *,
    eos_ids: Collection[int],
    refused: str | None = None,
) -> grammar.Constraint:
    """A fresh matcher of the constrained reply for one sequence (compiles: run it off the
    event loop). `refused` says why this model's batching cannot take a grammar, if so."""
    tools.check()
    if refused:
        raise InvalidArgumentError(
            f"tool_choice: forced tool calls are not available on this model: {refused}"
        )
    tokenizer = grammars.tokenizer()
    for function in tools.called():  # each alone first, so a refusal names its tool
        where = f"tools[{tools.functions.index(function)}].function.parameters"
        try:
            schema = function.schema()
        except ValueError as error:
            raise InvalidArgumentError(f"{where}: {error}") from None
        try:
            alone = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
        except Exception as error:  # llguidance names what it cannot compile
            raise InvalidArgumentError(f"{where}: cannot be compiled: {error}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(alone, tokenizer)
        if is_error:
            reason = "; ".join(message.strip() for message in messages) or "unknown error"
            raise InvalidArgumentError(f"{where}: cannot be enforced (llguidance): {reason}")
    lark = tool_grammar(tools, format)
    try:
        compiled = llguidance.LLMatcher.grammar_from_lark(lark)
    except Exception as error:
        raise InvalidArgumentError(f"tools: the forced call cannot be compiled: {error}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, tokenizer)
    if is_error:
        reason = "; ".join(message.strip() for message in messages) or "unknown error"
        raise InvalidArgumentError(f"tools: the forced call cannot be enforced (llguidance): {reason}")
    matcher = llguidance.LLMatcher(tokenizer, compiled)
    if matcher.is_error():
        raise InvalidArgumentError(
            f"tools: the forced call cannot be enforced (llguidance): {matcher.get_error()}"
        )
    return grammar.Constraint(matcher=matcher, eos_ids=frozenset(eos_ids))
