"""Where commands print: tables on stdout (full width when piped), JSON for scripts."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import typer
from rich.console import Console

__all__ = ["PIPE_WIDTH", "print_json", "stdout_console"]

# Rich falls back to 80 columns when stdout is not a terminal, and then squeezes and
# truncates table cells (`polic…`): piped output gets a line wide enough for any table.
PIPE_WIDTH = 1000


def stdout_console() -> Console:
    """A console on stdout: the terminal's width, or (piped, no COLUMNS set) PIPE_WIDTH."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=PIPE_WIDTH)


def print_json(document: Any) -> None:
    """One JSON document on stdout (`--json`): stable keys, no colour, one line."""
    typer.echo(json.dumps(document))
