"""`loadmaster config get [KEY] | set KEY VALUE | reset KEY`: runtime settings of the running
suite, through the gateway's admin API (docs/admin.md).

KEY is a dotted path (`scheduler.strategy`, `models.known.tiny-chat.pin`,
`models.allow_cloud_fallback`, `tenants.alice.weight`, `models.aliases.chat`); `config get`
lists the ones that may be set. VALUE is JSON (`true`, `2.5`, `{"models": ["a", "b"]}`,
`null`); a VALUE that is not JSON is taken as a string (`round_robin`). A value set here wins
over the config file's, on every gateway within a second and across restarts; `reset` takes
the file's again.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from loadmaster.cli._config import ConfigOption
from loadmaster.cli._output import print_json, stdout_console
from loadmaster.cli.admin_client import AdminError, ApiKeyOption, GatewayOption, admin_client, fail

__all__ = ["app", "parse_value"]

app = typer.Typer(help="Runtime settings of the running suite (get, set, reset).", no_args_is_help=True)
JsonOption = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]


def parse_value(text: str) -> Any:
    """JSON, else the text itself as a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call(config: Any, gateway: str | None, api_key: str | None, method: str, **kwargs: Any) -> Any:
    with admin_client(config, gateway, api_key) as client:
        try:
            return client.call(method, "/admin/v1/config", **kwargs)
        except AdminError as error:
            raise fail(error) from None


def _text(value: Any) -> str:
    return json.dumps(value)


@app.command()
def get(
    key: Annotated[str | None, typer.Argument(help="a dotted path; none: every runtime setting")] = None,
    config: ConfigOption = None,
    gateway: GatewayOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """The value in force (and whether it was set at run time)."""
    reply = _call(config, gateway, api_key, "GET", params={"key": key} if key else None)
    if as_json:
        print_json(reply)
        return
    out = stdout_console()
    if key:
        origin = "set at run time" if reply["stored"] else "from the config file"
        out.print(f"{key} = {_text(reply['value'])} ({origin}; the file says {_text(reply['configured'])})")
        return
    table = Table(title=f"runtime settings (version {reply['version']})")
    for column in ("key", "value", "set at run time"):
        table.add_column(column)
    stored = reply["stored"]
    for path, value in reply["values"].items():
        table.add_row(path, _text(value), "yes" if path in stored else "")
    for path, value in stored.items():
        if path not in reply["values"]:  # e.g. an entry removed at run time
            table.add_row(path, _text(value), "yes")
    out.print(table)


@app.command("set")
def set_value(
    key: Annotated[str, typer.Argument(help="a dotted path (`loadmaster config get` lists them)")],
    value: Annotated[str, typer.Argument(help="JSON; text that is not JSON is a string")],
    config: ConfigOption = None,
    gateway: GatewayOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """Set a runtime setting on every gateway (stored: it survives restarts)."""
    reply = _call(config, gateway, api_key, "PUT", body={"key": key, "value": parse_value(value)})
    if as_json:
        print_json(reply)
        return
    stdout_console().print(
        f"{key}: {_text(reply['previous'][key])} -> {_text(reply['values'][key])}", highlight=False
    )


@app.command()
def reset(
    key: Annotated[str, typer.Argument(help="a dotted path set at run time")],
    config: ConfigOption = None,
    gateway: GatewayOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """Drop the value set at run time: the config file's applies again."""
    reply = _call(config, gateway, api_key, "PUT", body={"key": key, "reset": True})
    if as_json:
        print_json(reply)
        return
    stdout_console().print(
        f"{key}: {_text(reply['previous'][key])} -> {_text(reply['values'][key])} (the config file's)",
        highlight=False,
    )
