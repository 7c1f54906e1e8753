"""One error hierarchy for every service and front end.

Each `LoadmasterError` subclass carries its gRPC status code, HTTP status and
edge `error_code` (the lower-case `ErrorCode` name without its prefix). Servers
map errors in one place each: the gRPC interceptor (`grpc_server`), the HTTP
handler and the edge reply builder all call `to_status` / `edge_error_code`.
Anything that is not a `LoadmasterError` becomes `internal`.
"""

from __future__ import annotations

import math
from typing import ClassVar

import grpc

from loadmaster.v1 import errors_pb2

__all__ = [
    "ERROR_CODE_TRAILER",
    "CancelledError_",
    "ExpiredError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "LoadmasterError",
    "NotFoundError",
    "OverflowError_",
    "PermissionDeniedError",
    "QueueFullError",
    "ResourceExhaustedError",
    "SupersededError",
    "UnauthenticatedError",
    "UnavailableError",
    "edge_code_name",
    "error_for_code",
    "from_grpc_error",
    "retry_after_header",
]


def edge_code_name(code: int) -> str:
    """`ERROR_CODE_NOT_FOUND` -> `"not_found"`; `ERROR_CODE_UNSPECIFIED` -> `""`."""
    if code == errors_pb2.ERROR_CODE_UNSPECIFIED:
        return ""
    return errors_pb2.ErrorCode.Name(code).removeprefix("ERROR_CODE_").lower()


class LoadmasterError(Exception):
    """Base of every error a client may see. `retryable` means another attempt may succeed."""

    code: ClassVar[int] = errors_pb2.ERROR_CODE_INTERNAL
    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    http_status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False
    # When a retry may succeed, if the raiser knows (a rate limit's next token): HTTP's
    # `Retry-After` (`retry_after_header`).
    retry_after_s: float | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def edge_code(self) -> str:
        return edge_code_name(self.code)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class InvalidArgumentError(LoadmasterError):
    code = errors_pb2.ERROR_CODE_INVALID_ARGUMENT
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class NotFoundError(LoadmasterError):
    code = errors_pb2.ERROR_CODE_NOT_FOUND
    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class ExpiredError(LoadmasterError):
    """The request's deadline passed before it could run."""

    code = errors_pb2.ERROR_CODE_EXPIRED
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class OverflowError_(LoadmasterError):  # noqa: N801, N818 - `OverflowError` is a builtin
    """A bounded queue was full; this request was dropped or refused."""

    code = errors_pb2.ERROR_CODE_OVERFLOW
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


QueueFullError = OverflowError_


class SupersededError(LoadmasterError):
    """A newer observation from the same client replaced this one (latest_only models)."""

    code = errors_pb2.ERROR_CODE_SUPERSEDED
    grpc_code = grpc.StatusCode.ABORTED
    http_status = 409


class UnavailableError(LoadmasterError):
    code = errors_pb2.ERROR_CODE_UNAVAILABLE
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    retryable = True


class InternalError(LoadmasterError):
    code = errors_pb2.ERROR_CODE_INTERNAL
    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500


class ResourceExhaustedError(LoadmasterError):
    """Not enough of something (GPU memory, rate-limit tokens) right now."""

    code = errors_pb2.ERROR_CODE_RESOURCE_EXHAUSTED
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class CancelledError_(LoadmasterError):  # noqa: N801, N818 - asyncio.CancelledError exists
    code = errors_pb2.ERROR_CODE_CANCELLED
    grpc_code = grpc.StatusCode.CANCELLED
    http_status = 499


class UnauthenticatedError(LoadmasterError):
    code = errors_pb2.ERROR_CODE_UNAUTHENTICATED
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


class PermissionDeniedError(LoadmasterError):
    code = errors_pb2.ERROR_CODE_PERMISSION_DENIED
    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403


class FailedPreconditionError(LoadmasterError):
    """The target is in the wrong state for this call (e.g. a lease that expired or was fenced)."""

    code = errors_pb2.ERROR_CODE_FAILED_PRECONDITION
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 412


_BY_CODE: dict[int, type[LoadmasterError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        ExpiredError,
        OverflowError_,
        SupersededError,
        UnavailableError,
        InternalError,
        ResourceExhaustedError,
        CancelledError_,
        UnauthenticatedError,
        PermissionDeniedError,
        FailedPreconditionError,
    )
}
_BY_GRPC: dict[grpc.StatusCode, type[LoadmasterError]] = {}
for _cls in _BY_CODE.values():
    _BY_GRPC.setdefault(_cls.grpc_code, _cls)


def error_for_code(code: int, message: str) -> LoadmasterError:
    """The error for a wire `ErrorCode` (unknown codes become `InternalError`)."""
    return _BY_CODE.get(code, InternalError)(message)


# The trailer in which a Loadmaster gRPC server names the error kind (set by ErrorInterceptor).
ERROR_CODE_TRAILER = "loadmaster-error-code"


def from_grpc_error(error: grpc.RpcError) -> LoadmasterError:
    """Turn a failed gRPC call into the matching `LoadmasterError`.

    A Loadmaster server names the exact error kind in a trailer (several kinds share
    a status code); for other servers the status code decides.
    """
    status = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == ERROR_CODE_TRAILER and value.isdigit() and int(value) in _BY_CODE:
            return _BY_CODE[int(value)](details or status.name.lower())
    cls = _BY_GRPC.get(status, InternalError)
    return cls(details or status.name.lower())


def retry_after_header(error: LoadmasterError) -> str | None:
    """The `Retry-After` value (whole seconds, at least 1) of an error answered with 429 or
    503; None for other errors."""
    if error.http_status not in (429, 503):
        return None
    wait = error.retry_after_s if error.retry_after_s is not None else 1.0
    return str(max(1, math.ceil(wait)))
