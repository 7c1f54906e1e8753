"""The one error hierarchy: each subclass has its own wire code, edge name and status mapping."""

from __future__ import annotations

import grpc
import pytest

from loadmaster.common import errors
from loadmaster.common.errors import (
    InternalError,
    LoadmasterError,
    OverflowError_,
    QueueFullError,
    UnavailableError,
    edge_code_name,
    error_for_code,
    from_grpc_error,
)
from loadmaster.v1 import errors_pb2


def all_subclasses(cls: type[LoadmasterError]) -> list[type[LoadmasterError]]:
    found: list[type[LoadmasterError]] = []
    for sub in cls.__subclasses__():
        found += [sub, *all_subclasses(sub)]
    return found


# Only the common library's own kinds: services may subclass them (imported in the same run).
SUBCLASSES = [cls for cls in all_subclasses(LoadmasterError) if cls.__module__ == errors.__name__]
NONZERO_CODES = [v for v in errors_pb2.ErrorCode.values() if v != errors_pb2.ERROR_CODE_UNSPECIFIED]


class FakeRpcError(grpc.RpcError):
    def __init__(
        self, code: grpc.StatusCode, details: str | None, trailers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details


def test_every_subclass_is_exported() -> None:
    assert {cls.__name__ for cls in SUBCLASSES} <= set(errors.__all__)
    assert len(SUBCLASSES) == len(NONZERO_CODES)


def test_every_subclass_has_a_distinct_code_and_edge_name() -> None:
    codes = [cls.code for cls in SUBCLASSES]
    edge_names = [cls("m").edge_code for cls in SUBCLASSES]
    assert len(set(codes)) == len(codes)
    assert len(set(edge_names)) == len(edge_names)
    assert sorted(codes) == sorted(NONZERO_CODES)  # and together they cover every wire code
    assert all(edge_names)


@pytest.mark.parametrize("cls", SUBCLASSES, ids=lambda c: c.__name__)
def test_edge_name_is_the_lower_case_enum_name(cls: type[LoadmasterError]) -> None:
    enum_name = errors_pb2.ErrorCode.Name(cls.code)
    assert cls("m").edge_code == enum_name.removeprefix("ERROR_CODE_").lower()
    assert isinstance(cls.grpc_code, grpc.StatusCode) and cls.grpc_code != grpc.StatusCode.OK
    assert 400 <= cls.http_status < 600


@pytest.mark.parametrize("code", NONZERO_CODES, ids=errors_pb2.ErrorCode.Name)
def test_error_for_code_round_trips_every_code(code: int) -> None:
    error = error_for_code(code, "why")
    assert error.code == code
    assert error.message == "why"
    assert type(error) in SUBCLASSES
    assert error_for_code(error.code, error.message).edge_code == error.edge_code


@pytest.mark.parametrize("code", [errors_pb2.ERROR_CODE_UNSPECIFIED, 999])
def test_error_for_unknown_codes_is_internal(code: int) -> None:
    error = error_for_code(code, "odd")
    assert type(error) is InternalError and error.message == "odd"


def test_edge_code_name() -> None:
    assert edge_code_name(errors_pb2.ERROR_CODE_UNSPECIFIED) == ""
    assert edge_code_name(errors_pb2.ERROR_CODE_NOT_FOUND) == "not_found"
    assert edge_code_name(errors_pb2.ERROR_CODE_INVALID_ARGUMENT) == "invalid_argument"
    assert edge_code_name(errors_pb2.ERROR_CODE_FAILED_PRECONDITION) == "failed_precondition"


def test_the_documented_edge_codes_exist() -> None:
    names = {cls("m").edge_code for cls in SUBCLASSES}
    documented = {
        "invalid_argument",
        "not_found",
        "expired",
        "overflow",
        "superseded",
        "unavailable",
        "internal",
    }
    assert documented <= names


def test_aliases_message_repr_and_retryable() -> None:
    assert QueueFullError is OverflowError_
    error = UnavailableError("worker gone")
    assert str(error) == error.message == "worker gone"
    assert repr(error) == "UnavailableError('worker gone')"
    assert [cls.__name__ for cls in SUBCLASSES if cls.retryable] == ["UnavailableError"]
    assert LoadmasterError("x").edge_code == "internal"


@pytest.mark.parametrize(
    "cls",
    SUBCLASSES,
    ids=lambda c: c.__name__,
)
def test_from_grpc_error_recovers_the_raised_class(cls: type[LoadmasterError]) -> None:
    trailer = ((errors.ERROR_CODE_TRAILER, str(cls.code)),)
    error = from_grpc_error(FakeRpcError(cls.grpc_code, "details", trailer))
    assert type(error) is cls
    assert error.message == "details"


def test_from_grpc_error_for_unmapped_status_is_internal_and_keeps_a_message() -> None:
    error = from_grpc_error(FakeRpcError(grpc.StatusCode.DATA_LOSS, "lost"))
    assert type(error) is InternalError and error.message == "lost"
    error = from_grpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, ""))
    assert type(error) is UnavailableError and error.message == "unavailable"
