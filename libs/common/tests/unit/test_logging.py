"""Log lines are real logfmt or JSON: an independent parser reads every field back."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import logfmtkv
import pytest

from loadmaster.common.logging import LogFormat, setup_logging

TRICKY = 'stopped "robot-1" at x=1, then\nrestarted\tagain (ünïcode \\ backslash)'


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield stream
    root.handlers[:], level = saved
    root.setLevel(level)


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def emit(log_format: LogFormat, stream: io.StringIO) -> None:
    setup_logging("gateway", "DEBUG", log_format, stream=stream)
    log = logging.getLogger("loadmaster.gateway.test")
    log.warning(
        "request %s failed", TRICKY, extra={"request_id": "r 1", "model": "double", "client": "arm=1"}
    )
    try:
        raise ValueError("bad value")
    except ValueError:
        log.exception("handler crashed")


def test_logfmt_lines_parse_back_field_for_field(captured: io.StringIO) -> None:
    emit("logfmt", captured)
    first, second = lines(captured)  # a traceback stays inside its record's line
    record = logfmtkv.parse(first)
    assert record["level"] == "warning"
    assert record["service"] == "gateway"
    assert record["logger"] == "loadmaster.gateway.test"
    assert record["msg"] == f"request {TRICKY} failed"
    assert (record["request_id"], record["model"], record["client"]) == ("r 1", "double", "arm=1")
    assert record["ts"].endswith("Z")
    failure = logfmtkv.parse(second)
    assert failure["msg"] == "handler crashed"
    assert "ValueError: bad value" in failure["exc_info"]


def test_json_lines_carry_the_same_fields(captured: io.StringIO) -> None:
    emit("json", captured)
    first, second = (json.loads(line) for line in lines(captured))
    assert first["msg"] == f"request {TRICKY} failed"
    assert (first["level"], first["service"], first["request_id"], first["model"]) == (
        "warning",
        "gateway",
        "r 1",
        "double",
    )
    assert "message" not in first
    assert "ValueError: bad value" in second["exc_info"]


def test_library_loggers_go_through_the_same_formatter(captured: io.StringIO) -> None:
    uvicorn_error = logging.getLogger("uvicorn.error")
    own = logging.StreamHandler(io.StringIO())  # as uvicorn's default log config installs
    uvicorn_error.addHandler(own)
    uvicorn_error.propagate = False
    setup_logging("metrics", "INFO", "logfmt", stream=captured)
    uvicorn_error.error("Exception in ASGI application")
    record = logfmtkv.parse(lines(captured)[-1])
    assert (record["service"], record["logger"]) == ("metrics", "uvicorn.error")
    assert own not in uvicorn_error.handlers


def test_trace_id_comes_from_the_current_span(captured: io.StringIO) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    setup_logging("scheduler", "INFO", "logfmt", stream=captured)
    with TracerProvider().get_tracer("test").start_as_current_span("op") as span:
        logging.getLogger("t").info("inside")
        expected = format(span.get_span_context().trace_id, "032x")
    assert logfmtkv.parse(lines(captured)[-1])["trace_id"] == expected
