"""Entry point shared by `python -m loadmaster.<service>`: read `--config` (default:
`$LOADMASTER_CONFIG`, else built-in defaults), build the settings once, set up logging, run
the service's async main.

Exit codes: 0 stopped cleanly; 1 failed; 2 usage or configuration error (one message on
stderr naming the file and the key, no traceback)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from loadmaster.common import internal_auth, transport
from loadmaster.common.config import ConfigError, Settings, load_settings
from loadmaster.common.credentials import Identity
from loadmaster.common.logging import setup_logging
from loadmaster.common.tracing import setup_tracing, shutdown_tracing

__all__ = ["default_instance_id", "loop_factory", "run_service"]


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed: it cuts the per-message cost of every socket hop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def run_service(
    name: str, main: Callable[[Settings], Coroutine[Any, Any, None]], argv: list[str] | None = None
) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m loadmaster.{name.replace('-', '_')}")
    parser.add_argument(
        "--config",
        default=os.environ.get("LOADMASTER_CONFIG") or None,
        help="path to loadmaster.yaml (default: $LOADMASTER_CONFIG, else built-in defaults)",
    )
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config)
    except ConfigError as error:
        print(f"{parser.prog}: {error.message}", file=sys.stderr)
        sys.exit(2)
    setup_logging(name, settings.log_level, settings.log_format)
    setup_tracing(name)  # on only when OTEL_EXPORTER_OTLP_ENDPOINT is set
    identity = Identity(name, default_instance_id())
    transport.setup(transport.from_settings(settings))
    internal_auth.setup(
        internal_auth.credentials_from_settings(settings, identity), insecure=settings.internal_auth.insecure
    )
    try:
        with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(main(settings))
    except internal_auth.InsecureBindError as error:
        logging.getLogger(name).error("%s", error)
        sys.exit(2)
    finally:
        shutdown_tracing()
    sys.exit(0)
