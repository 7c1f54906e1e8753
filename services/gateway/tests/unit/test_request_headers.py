"""The X-Loadmaster-* request headers every HTTP route reads, and Retry-After on 429s."""

from __future__ import annotations

import json

import pytest

from loadmaster.common.errors import (
    InvalidArgumentError,
    OverflowError_,
    ResourceExhaustedError,
    UnavailableError,
)
from loadmaster.gateway.frontends.openai_schema import parse_chat
from loadmaster.gateway.frontends.request_headers import RequestHints, hints_from, retry_after, with_hints


def test_headers_parse_into_hints() -> None:
    hints = hints_from(
        {
            "x-loadmaster-priority": "0",
            "x-loadmaster-urgency": "0.25",
            "x-loadmaster-deadline-ms": "1500",
            "x-loadmaster-client-id": " arm-1 ",
        }
    )
    assert hints == RequestHints(priority=0, urgency=0.25, deadline_ms=1500.0, client_id="arm-1")
    assert hints_from({}) == RequestHints()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-loadmaster-priority", "-1"),
        ("x-loadmaster-priority", "256"),
        ("x-loadmaster-priority", "high"),
        ("x-loadmaster-urgency", "1.5"),
        ("x-loadmaster-urgency", "nan"),
        ("x-loadmaster-deadline-ms", "0"),
        ("x-loadmaster-deadline-ms", "inf"),
        ("x-loadmaster-client-id", "x" * 257),
        ("x-loadmaster-client-id", "  "),
    ],
)
def test_a_bad_header_is_a_400_naming_it(name: str, value: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        hints_from({name: value})
    spelled = "-".join(part.capitalize() for part in name.split("-"))
    assert f"header {spelled}" in caught.value.message


def test_the_body_wins_over_a_header() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "x_priority": 3}
    request = parse_chat(json.dumps(body).encode())
    hinted = with_hints(request, RequestHints(priority=0, deadline_ms=100.0, client_id="c"))
    assert (hinted.priority, hinted.deadline_ms, hinted.client_id) == (3, 100.0, "c")
    assert with_hints(request, RequestHints()) is request


def test_429s_and_503s_say_when_to_retry() -> None:
    def limited(wait_s: float) -> ResourceExhaustedError:
        error = ResourceExhaustedError("slow down")
        error.retry_after_s = wait_s
        return error

    assert retry_after(limited(2.2)) == {"Retry-After": "3"}
    assert retry_after(limited(0.01)) == {"Retry-After": "1"}
    assert retry_after(OverflowError_("queue full")) == {"Retry-After": "1"}
    assert retry_after(UnavailableError("later")) == {"Retry-After": "1"}
    assert retry_after(InvalidArgumentError("bad")) == {} and retry_after(ValueError("x")) == {}


def test_kserve_infer_takes_the_headers_where_its_parameters_say_nothing() -> None:
    from loadmaster.gateway.calls import InferenceCall
    from loadmaster.gateway.frontends.http import _apply_hints

    hints = RequestHints(priority=0, urgency=0.5, deadline_ms=250.0, client_id="arm-1")
    call = InferenceCall("r1", "key-name", "policy", (), b"", priority=1, timeout_ms=0.0)
    _apply_hints(call, {}, hints)
    assert (call.priority, call.urgency, call.timeout_ms, call.client_id) == (0, 0.5, 250.0, "arm-1")
    stated = InferenceCall("r2", "key-name", "policy", (), b"", priority=3, timeout_ms=900.0)
    _apply_hints(stated, {"priority": 3, "timeout": 900}, hints)
    assert (stated.priority, stated.timeout_ms) == (3, 900.0)  # the v2 parameters win
