"""Structured logging: one line per record, as logfmt or JSON, with the same fields in both.

Every line carries `ts`, `level`, `service`, `logger` and `msg`; a record logged with
`extra={"request_id": ..., "model": ..., "client": ...}` carries those as fields of their own,
and `trace_id` is added from the current OpenTelemetry span when one is recording. Formatting
is done by maintained libraries (`logfmter` quotes and escapes real logfmt; `python-json-logger`
writes the JSON), and uvicorn's and grpc's loggers are routed through the same handler, so a
pipeline reads one format from every process. A traceback stays inside its record's line
(`exc_info` field), never a line of its own.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Literal, TextIO

from logfmter import Logfmter
from opentelemetry import trace
from pythonjsonlogger.json import JsonFormatter

__all__ = ["LOG_FIELDS", "LogFormat", "setup_logging"]

LogFormat = Literal["logfmt", "json"]

# The request-scoped fields that call sites pass in `extra=` (never formatted into `msg`).
LOG_FIELDS = ("request_id", "trace_id", "model", "client")

# Loggers of libraries that would otherwise install handlers (and formats) of their own.
_LIBRARY_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "grpc", "asyncio")


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class _TraceIdFilter(logging.Filter):
    """Adds `trace_id` from the current span when the record does not carry one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "trace_id", None) is None:
            context = trace.get_current_span().get_span_context()
            if context.is_valid:
                record.trace_id = format(context.trace_id, "032x")
        return True


class _LogfmtFormatter(Logfmter):
    """`ts level service logger` first, then `msg`, the record's extra fields and `exc_info`."""

    def __init__(self, service: str) -> None:
        super().__init__(keys=[], mapping={})
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        head = self.format_params(
            {
                "ts": _timestamp(record),
                "level": record.levelname.lower(),
                "service": self._service,
                "logger": record.name,
            }
        )
        return f"{head} {super().format(record)}"


class _JsonLineFormatter(JsonFormatter):
    def __init__(self, service: str) -> None:
        super().__init__(static_fields={"service": service}, json_ensure_ascii=False)

    def add_fields(
        self, log_data: dict[str, object], record: logging.LogRecord, message_dict: dict[str, object]
    ) -> None:
        log_data["ts"] = _timestamp(record)
        log_data["level"] = record.levelname.lower()
        log_data["logger"] = record.name
        log_data["msg"] = record.getMessage()
        super().add_fields(log_data, record, message_dict)
        log_data.pop("message", None)


def setup_logging(
    service: str, level: str = "INFO", log_format: LogFormat = "logfmt", *, stream: TextIO | None = None
) -> None:
    """Route every record of the process to one handler on `stream` (default: standard error)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    formatter: logging.Formatter = (
        _JsonLineFormatter(service) if log_format == "json" else _LogfmtFormatter(service)
    )
    handler.setFormatter(formatter)
    handler.addFilter(_TraceIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in _LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate = True
