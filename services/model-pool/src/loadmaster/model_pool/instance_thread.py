"""An engine instance's own thread: work handed to it runs there, in order, one piece at a time.

    thread = InstanceThread("model-policy-0")
    await asyncio.wrap_future(thread.submit(engine.load))   # a Future, for load/warm-up/unload
    thread.post(batcher_chain, instance, batch)             # fire and forget, for batches
    thread.shutdown()                                       # after the work already handed over

Every engine method runs on its instance's thread, never on the event loop (engines/base.py),
so a `ThreadPoolExecutor(max_workers=1)` did the job; but each of its `submit`s builds a
Future and a work item and takes a semaphore and a condition, and that was the largest single
cost of a batch on the loop (~10 us of ~130 us per request for a 2 us model, py-spy). A batch
needs none of it: the batcher answers its requests through its own callbacks. So `post`
is one `SimpleQueue.put` (C, one lock), and only the rare calls that want a result
(`submit`) pay for a Future.

Work that raises is logged and the thread goes on with the next piece. Work handed over
after `shutdown` raises `InternalError` at once, never silently dropped; work handed over
before it runs first.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from loadmaster.common.errors import InternalError

__all__ = ["InstanceThread"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_Work = tuple[Callable[..., object], tuple[Any, ...]] | None  # None: the thread stops


class InstanceThread:
    """One daemon thread running the callables handed to it, in the order they were handed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[_Work] = queue.SimpleQueue()
        self._lock = threading.Lock()  # `_closed` and the stop marker: nothing is queued behind it
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, work: Callable[..., object], *args: Any) -> None:
        """Run `work(*args)` on the thread after what was handed over before; no result, and an
        exception it raises is only logged. Raises `InternalError` after `shutdown`."""
        with self._lock:
            if self._closed:
                raise InternalError(f"instance thread {self.name} is shut down")
            self._queue.put((work, args))

    def submit(self, work: Callable[..., T], *args: Any) -> Future[T]:
        """`post`, with a Future that gets what `work(*args)` returns or raises."""
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return  # cancelled while it waited
            try:
                result = work(*args)
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(result)

        self.post(run)
        return future

    def shutdown(self) -> None:
        """Refuse new work; the thread ends once the work handed over before this has run."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait (bounded) for the thread to end after `shutdown`; whether it has ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        get = self._queue.get
        while (work := get()) is not None:
            function, args = work
            try:
                function(*args)
            except BaseException:
                log.exception("work on instance thread %s failed", self.name)
            del work, function, args  # hold no batch between pieces of work
