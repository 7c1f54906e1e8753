"""What every HTTP route reads from and writes to headers, whatever its dialect.

Request headers (every HTTP route: OpenAI, Ollama, Anthropic, KServe v2 infer):

    X-Loadmaster-Priority     0..255, 0 = highest (as on the edge)
    X-Loadmaster-Urgency      0..1
    X-Loadmaster-Deadline-Ms  > 0: the request is refused `expired` (504) if still queued then
    X-Loadmaster-Client-Id    up to 256 characters: whose request this is (cadence, fairness)

A body field that says the same (OpenAI's `x_priority` ...) wins over its header. A header
that does not parse is a 400 naming the header: a client that asked for priority 0 and got
the default would not know.

Response header: every 429 and 503 carries `Retry-After` (whole seconds, at least 1): the
rate limiter's own wait when it knows it, else one second (loadmaster.common.errors).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from loadmaster.common.errors import InvalidArgumentError, LoadmasterError, retry_after_header

__all__ = [
    "CLIENT_ID",
    "DEADLINE_MS",
    "PRIORITY",
    "URGENCY",
    "RequestHints",
    "hints_from",
    "retry_after",
    "with_hints",
]

PRIORITY = "x-loadmaster-priority"
URGENCY = "x-loadmaster-urgency"
DEADLINE_MS = "x-loadmaster-deadline-ms"
CLIENT_ID = "x-loadmaster-client-id"
MAX_CLIENT_ID = 256
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RequestHints:
    priority: int | None = None
    urgency: float | None = None
    deadline_ms: float | None = None
    client_id: str | None = None


def hints_from(headers: Mapping[str, str]) -> RequestHints:
    """The `X-Loadmaster-*` headers of a request; `InvalidArgumentError` naming a bad one."""
    priority = headers.get(PRIORITY)
    urgency = headers.get(URGENCY)
    deadline = headers.get(DEADLINE_MS)
    client_id = headers.get(CLIENT_ID)
    hints = RequestHints()
    if priority is not None:
        value = priority.strip()
        if not value.isdigit() or int(value) > 255:
            raise InvalidArgumentError(
                f"header X-Loadmaster-Priority: {priority!r} is not an integer in 0..255"
            )
        hints = dataclasses.replace(hints, priority=int(value))
    if urgency is not None:
        number = _number(urgency)
        if number is None or not 0.0 <= number <= 1.0:
            raise InvalidArgumentError(f"header X-Loadmaster-Urgency: {urgency!r} is not a number in [0, 1]")
        hints = dataclasses.replace(hints, urgency=number)
    if deadline is not None:
        number = _number(deadline)
        if number is None or number <= 0.0:
            raise InvalidArgumentError(f"header X-Loadmaster-Deadline-Ms: {deadline!r} is not a number > 0")
        hints = dataclasses.replace(hints, deadline_ms=number)
    if client_id is not None:
        value = client_id.strip()
        if not value or len(value) > MAX_CLIENT_ID:
            raise InvalidArgumentError(
                f"header X-Loadmaster-Client-Id: 1 to {MAX_CLIENT_ID} characters, got {len(value)}"
            )
        hints = dataclasses.replace(hints, client_id=value)
    return hints


def _number(text: str) -> float | None:
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def with_hints(request: T, hints: RequestHints) -> T:
    """`request` (a frozen dataclass with some of the four fields) with each of them it leaves
    unset taken from the headers."""
    changes = {
        name: getattr(hints, name)
        for name in ("priority", "urgency", "deadline_ms", "client_id")
        if hasattr(request, name) and getattr(request, name) is None and getattr(hints, name) is not None
    }
    if not changes:
        return request
    replaced: Any = dataclasses.replace(request, **changes)  # type: ignore[type-var]
    return replaced  # type: ignore[no-any-return]


def retry_after(error: BaseException) -> dict[str, str]:
    """The `Retry-After` header for a 429 or 503 (empty for anything else)."""
    if not isinstance(error, LoadmasterError):
        return {}
    value = retry_after_header(error)
    return {"Retry-After": value} if value is not None else {}
