"""`loadmaster guardrails list|add|remove`: the blocklist rules of the running suite, through
the gateway's admin API (docs/admin.md). A word matches whole words, ignoring case; a pattern
is a Python regular expression. A change reaches every gateway within a second.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from loadmaster.cli._config import ConfigOption
from loadmaster.cli._output import print_json, stdout_console
from loadmaster.cli.admin_client import AdminError, ApiKeyOption, GatewayOption, admin_client, fail

__all__ = ["app"]

app = typer.Typer(
    help="Guardrail rules (blocked words and patterns) of the running suite.", no_args_is_help=True
)
JsonOption = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]


def _call(
    config: Any, gateway: str | None, api_key: str | None, method: str, path: str, body: Any = None
) -> Any:
    with admin_client(config, gateway, api_key) as client:
        try:
            return client.call(method, path, body=body)
        except AdminError as error:
            raise fail(error) from None


@app.command("list")
def list_rules(
    config: ConfigOption = None,
    gateway: GatewayOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """The rules in force (the config file's and those added at run time), with their ids."""
    rules = _call(config, gateway, api_key, "GET", "/admin/v1/guardrails")["guardrails"]
    if as_json:
        print_json({"guardrails": rules})
        return
    table = Table(title="guardrails")
    for column in ("id", "kind", "value", "source", "added by"):
        table.add_column(column)
    for rule in rules:
        table.add_row(rule["id"], rule["kind"], rule["value"], rule["source"], rule["created_by"] or "-")
    stdout_console().print(table)


@app.command()
def add(
    word: Annotated[str | None, typer.Option("--word", help="block this word (whole word, any case)")] = None,
    pattern: Annotated[str | None, typer.Option("--pattern", help="block this regular expression")] = None,
    config: ConfigOption = None,
    gateway: GatewayOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """Block a word or a pattern in prompts and completions."""
    if (word is None) == (pattern is None):
        raise typer.BadParameter("give one of --word and --pattern")
    kind, value = ("word", word) if word is not None else ("pattern", pattern)
    rule = _call(config, gateway, api_key, "POST", "/admin/v1/guardrails", {"kind": kind, "value": value})
    if as_json:
        print_json(rule)
        return
    stdout_console().print(f"added {rule['kind']} rule {rule['id']}", highlight=False)


@app.command()
def remove(
    rule_id: Annotated[str, typer.Argument(metavar="ID", help="the rule's id (`guardrails list`)")],
    config: ConfigOption = None,
    gateway: GatewayOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """Remove a rule (one from the config file too: it stays removed across restarts)."""
    rule = _call(config, gateway, api_key, "DELETE", f"/admin/v1/guardrails/{rule_id}")
    if as_json:
        print_json(rule)
        return
    stdout_console().print(f"removed {rule['kind']} rule {rule['id']}", highlight=False)
