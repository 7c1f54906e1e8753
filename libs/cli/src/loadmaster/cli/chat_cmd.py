"""`loadmaster chat MODEL`: chat with a generative model through the gateway's OpenAI API.

Replies stream into the terminal as they are generated. The conversation is kept and sent
again with each turn; `--system` sets a system message, `--priority` the request priority
(0 = highest, Loadmaster's `x_priority`). Ctrl-C stops the reply being generated (closing the
stream cancels the generation at the gateway); Ctrl-D or an empty line at the start ends the
chat. `-m TEXT` sends one message and exits, for scripts.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import openai
import typer
from openai.types.chat import ChatCompletionMessageParam
from rich.console import Console

from loadmaster.cli._config import ConfigOption, settings_from
from loadmaster.common.config import Settings

__all__ = ["chat", "gateway_url"]

err = Console(stderr=True)


def gateway_url(settings: Settings) -> str:
    """The gateway's HTTP base address as a client on this host reaches it."""
    host = settings.gateway.http_host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{settings.gateway.http_port}"


def _reply(
    client: openai.OpenAI,
    model: str,
    messages: list[ChatCompletionMessageParam],
    extra: dict[str, Any],
    *,
    max_tokens: int,
    temperature: float | None,
) -> str:
    """Stream one reply to stdout; returns its text (what came before a Ctrl-C, if any)."""
    parts: list[str] = []
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        stream=True,
        max_tokens=max_tokens,
        temperature=temperature,
        extra_body=extra,
    )
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text = chunk.choices[0].delta.content
                parts.append(text)
                sys.stdout.write(text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        err.print("\n[dim](stopped)[/dim]")
    finally:
        stream.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts)


def chat(
    model: Annotated[str, typer.Argument(help="a generative model (or alias) the gateway serves")],
    config: ConfigOption = None,
    gateway: Annotated[
        str | None, typer.Option(help="the gateway's HTTP address (default: from the config)")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="LOADMASTER_API_KEY", help="an API key with the infer scope")
    ] = None,
    priority: Annotated[int | None, typer.Option(min=0, help="0 = most urgent")] = None,
    system: Annotated[str | None, typer.Option(help="a system message to start the chat with")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="tokens per reply at most")] = 256,
    temperature: Annotated[float | None, typer.Option(min=0.0, max=2.0)] = None,
    message: Annotated[
        str | None, typer.Option("--message", "-m", help="send this one message and exit")
    ] = None,
) -> None:
    """Chat with MODEL, streaming each reply as it is generated."""
    base = gateway or gateway_url(settings_from(config))
    client = openai.OpenAI(base_url=base.rstrip("/") + "/v1", api_key=api_key or "unused", max_retries=0)
    extra: dict[str, Any] = {"x_client_id": "loadmaster-chat"}
    if priority is not None:
        extra["x_priority"] = priority
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": system}] if system else []
    turns = [message] if message is not None else None
    while True:
        if turns is not None:
            if not turns:
                return
            text = turns.pop()
        else:
            try:
                text = input("you> ")
            except (EOFError, KeyboardInterrupt):
                err.print()
                return
            if not text.strip():
                return
        messages.append({"role": "user", "content": text})
        try:
            answer = _reply(client, model, messages, extra, max_tokens=max_tokens, temperature=temperature)
        except openai.APIStatusError as error:
            err.print(f"[red]{error.status_code}:[/red] {error.message}")
            messages.pop()
            if turns is not None:
                raise typer.Exit(2 if error.status_code in (400, 404) else 1) from None
            continue
        except openai.APIConnectionError as error:
            err.print(f"[red]cannot reach the gateway at {base}:[/red] {error}")
            raise typer.Exit(1) from None
        messages.append({"role": "assistant", "content": answer})
