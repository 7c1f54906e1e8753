"""The `--config` option every command shares, and reading it.

`--config` defaults to `$LOADMASTER_CONFIG`; with neither, the built-in defaults (under
`LOADMASTER_*` environment overrides) apply. A configuration that cannot be used ends the
command with one message naming the file and the key, and exit code 2 (no traceback).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from loadmaster.common.config import ConfigError, Settings, load_settings

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "ConfigOption", "config_problem", "settings_from"]

EXIT_OK = 0
EXIT_FAILURE = 1  # a service or Redis down, a refused request, a service that failed
EXIT_USAGE = 2  # a usage or configuration error, or something not found

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        envvar="LOADMASTER_CONFIG",
        help="loadmaster.yaml (default: $LOADMASTER_CONFIG, else built-in defaults)",
    ),
]


def config_problem(error: ConfigError) -> typer.Exit:
    """Print `error` on stderr as one message (no traceback); the exit to raise (code 2)."""
    message = Text.assemble(("error: ", "red"), error.message)  # not markup: it may hold "[...]"
    Console(stderr=True, highlight=False).print(message, soft_wrap=True)
    return typer.Exit(EXIT_USAGE)


def settings_from(config: Path | None, **overrides: Any) -> Settings:
    """`load_settings(config)`; a `ConfigError` ends the command (exit 2) with its message."""
    try:
        return load_settings(config, **overrides)
    except ConfigError as error:
        raise config_problem(error) from None
