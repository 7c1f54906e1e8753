"""`replay-chat`: answers with the last user message's text, `PIECE` characters at a time.

A client that sends `<tool_call>{"name": "f", "arguments": {...}}</tool_call>` gets that text
back as the model's reply, so the worker's tool-call parser reads a real stream; with tools
offered, the tools' names are checked as for any model. `supports_tools`: its (pretend)
template shows tools to the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

PIECE = 3


class ReplayChat:
    supports_tools = True

    def generate(self, request: dict[str, Any]) -> Iterator[str]:
        messages = request["messages"] or [{"role": "user", "content": request["prompt"] or ""}]
        text = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        for start in range(0, len(text), PIECE):
            yield text[start : start + PIECE]
