"""Hand-offs between the event loop and the engines' threads.

    thread = EngineThread("model-policy-0")
    await loop.run_in_executor(thread, engine.load)   # lifecycle calls: a Future each
    thread.post(batcher.run, batch)                   # batches: no Future
    thread.shutdown(wait=False)

    inbox = LoopInbox(loop)                           # the way back
    inbox.post(batcher.finish, batch, results)        # from any thread; runs on the loop
    inbox.close()

An `EngineThread` runs the calls given to it one at a time, in order, so an engine
may keep thread-affine state (CUDA streams, interpreter handles). It is an
`Executor`, so `run_in_executor` and `asyncio.wrap_future` work with it as with a
one-thread `ThreadPoolExecutor`.

Why not that pool and `call_soon_threadsafe`: each batch crosses threads twice, and
for a small model run one request at a time those crossings are a large part of what a
request costs the worker. The pool builds a
Future (with a Condition and an RLock) and a work item per call and takes and gives
back a Python Semaphore on both sides; and both it and `call_soon_threadsafe` wake the
other thread while holding the GIL, so the thread they woke starts by waiting for it.
Here a call is a deque append plus a one-byte pipe write, a system call made without
the GIL, so the woken thread can run at once (measured on 2 cores: a loop -> thread ->
loop round trip costs ~10 us of CPU against ~30 us).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

__all__ = ["EngineThread", "LoopInbox"]

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_T = TypeVar("_T")
_Call = tuple[Callable[..., object], tuple[Any, ...]]
_DRAIN_BYTES = 4096


class _Doorbell:
    """A pipe: `ring` (any thread, never blocks) wakes whoever waits on the read end. Rings
    coalesce: a full pipe already holds a wake-up, so a ring that finds it full is dropped."""

    def __init__(self, *, blocking_reads: bool) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        os.set_blocking(self.read_fd, blocking_reads)

    def ring(self) -> None:
        try:
            os.write(self._write_fd, b"\0")
        except BlockingIOError:  # full: a wake-up is pending already
            pass

    def take(self) -> None:
        """Consume the rings so far (blocks for one with `blocking_reads`)."""
        try:
            os.read(self.read_fd, _DRAIN_BYTES)
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self._write_fd)


class EngineThread(Executor):
    """A single thread running the calls posted or submitted to it, in order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: collections.deque[_Call | None] = collections.deque()
        self._bell = _Doorbell(blocking_reads=True)
        self._closed = False
        # A daemon, so an engine call that never returns cannot keep the process from exiting.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        """Run `fn(*args)` on the thread without a Future: `fn` answers for itself (whatever it
        raises is only logged). Raises RuntimeError after `shutdown`."""
        if self._closed:
            raise RuntimeError(f"engine thread {self.name} is shut down")
        self._calls.append((fn, args))
        self._bell.ring()

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        future: Future[_T] = Future()

        def call() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(result)

        self.post(call)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more calls; the thread ends after those already given (`cancel_futures` is
        not supported: lifecycle calls queued here must run, an unload frees memory)."""
        if not self._closed:
            self._closed = True
            self._calls.append(None)
            self._bell.ring()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        calls = self._calls
        while True:
            self._bell.take()
            while calls:
                call = calls.popleft()
                if call is None:
                    self._bell.close()
                    return
                fn, args = call
                try:
                    fn(*args)
                except BaseException:
                    log.exception("engine thread %s: a call failed", self.name)


class LoopInbox:
    """Calls posted from any thread, run on the event loop in the order they were posted.
    Create and close it on the loop, and close it only once no thread posts any more."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._calls: collections.deque[_Call] = collections.deque()
        self._bell = _Doorbell(blocking_reads=False)
        self._closed = False
        loop.add_reader(self._bell.read_fd, self._run)

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        self._calls.append((fn, args))
        self._bell.ring()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._loop.is_closed():
            self._loop.remove_reader(self._bell.read_fd)
        self._bell.close()

    def _run(self) -> None:
        self._bell.take()
        calls = self._calls
        while calls:
            fn, args = calls.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("a call posted to the event loop failed")
