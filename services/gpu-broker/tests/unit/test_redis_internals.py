"""What `_coalesce.py` assumes of redis-py beyond its public API, checked against the installed
version (the gpu-broker's pyproject pins the versions this passed on): `open_stream` lets
redis-py open and authenticate a connection, then takes its stream pair from `_reader` and
`_writer` and sets both to None, after which redis-py treats the connection as closed and
never touches the streams again. Fails when an upgrade moves them."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ConnectionError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
)

from loadmaster.gpu_broker._coalesce import new_reader, reply_value


@pytest.mark.parametrize("kind", [Connection, SSLConnection, UnixDomainSocketConnection])
def test_a_connection_keeps_its_streams_in_reader_and_writer(kind: type[AbstractConnection]) -> None:
    connection = kind()
    assert connection._reader is None and connection._writer is None
    connect = inspect.getsource(kind._connect)
    assert "self._reader = reader" in connect and "self._writer = writer" in connect


async def test_a_connection_whose_streams_were_taken_counts_as_closed() -> None:
    connection = Connection()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, protocol = _FakeTransport(), asyncio.StreamReaderProtocol(reader)
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)  # type: ignore[arg-type]
    connection._reader, connection._writer = reader, writer  # as _connect leaves them
    assert connection.is_connected
    connection._reader = connection._writer = None  # what open_stream does
    assert not connection.is_connected
    await connection.disconnect()  # closes nothing: the streams are ours
    del connection  # and its __del__ leaves them alone
    assert not transport.closed


def test_error_replies_map_to_redis_py_exceptions_by_their_code() -> None:
    reader = new_reader()
    reader.feed(
        b"-NOSCRIPT No matching script.\r\n-READONLY You can't write against a read only replica.\r\n"
        b"-LOADING Redis is loading the dataset in memory\r\n-NOAUTH Authentication required.\r\n"
        b"-ERR unknown op\r\n"
    )
    errors = [reply_value(reader.gets()) for _ in range(5)]
    assert [type(error) for error in errors] == [
        NoScriptError,
        ReadOnlyError,
        BusyLoadingError,
        AuthenticationError,
        ResponseError,
    ]
    assert str(errors[0]) == "No matching script." and str(errors[4]) == "ERR unknown op"
    # Connection-level errors are redis-py ConnectionErrors: the store answers UNAVAILABLE.
    assert all(isinstance(error, ConnectionError) for error in errors[2:4])
    assert reply_value(["ok", 1]) == ["ok", 1]


class _FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed
