"""Live metric samples from the metrics service (`MetricsService.Watch`), delivered to a callback.

    from loadmaster.client import on_metric

    with on_metric(lambda s: print(s.name, s.value, s.labels), names=["e2e_latency_ms"],
                   labels={"model": "double"}, address="127.0.0.1:50054") as subscription:
        subscription.wait_ready(timeout_s=5)   # from here on, nothing reported is missed
        ...

The callback runs on the subscription's own thread, one sample at a time in arrival
order; an exception in it is logged and the stream goes on. When the metrics service
goes away the subscription reconnects with backoff (samples reported meanwhile are
not replayed) until `close()`. Keepalive pings notice a peer that vanished without closing
its connection, and a watch the service does not confirm within `ready_timeout_s` is tried
again on a fresh connection.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from loadmaster.common import internal_auth
from loadmaster.common.grpc_client import CLIENT_OPTIONS
from loadmaster.common.retry import Backoff
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc

__all__ = ["MetricSample", "MetricSubscription", "on_metric"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MetricSample:
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)  # includes `service`, the reporter
    timestamp_unix_ns: int = 0


MetricCallback = Callable[[MetricSample], object]


# The suite's options (keepalive pings find a silent peer within 2 s, docs/liveness.md; a hung connection
# handshake is given up after 0.2-2 s, not gRPC's default 20 s), and a connection of the
# subscription's own: by default channels to one address share one from a process-wide pool,
# so a reconnect could land on the connection to the service instance that just went away.
_CHANNEL_OPTIONS = [*CLIENT_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]


class MetricSubscription:
    """A running Watch; close it (or leave its `with` block) to stop."""

    def __init__(
        self,
        callback: MetricCallback,
        *,
        address: str,
        names: Iterable[str] = (),
        labels: Mapping[str, str] | None = None,
        max_backoff_s: float = 2.0,
        ready_timeout_s: float = 5.0,
    ) -> None:
        self._callback = callback
        self._address = address
        self._request = metrics_pb2.MetricsServiceWatchRequest(names=list(names), labels=dict(labels or {}))
        self._max_backoff_s = max_backoff_s
        self._ready_timeout_s = ready_timeout_s
        self._closed = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._call: grpc.Future | None = None
        self.received = 0  # samples delivered to the callback
        self.callback_errors = 0
        self._thread = threading.Thread(target=self._run, name=f"on_metric-{address}", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """True once the service has registered the watch: samples reported after that arrive."""
        return self._ready.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        self._closed.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def __enter__(self) -> MetricSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        backoff = Backoff(first_s=0.1, max_s=self._max_backoff_s)
        while not self._closed.is_set():
            try:
                # Carries this process's internal credential when it has one (internal_auth).
                with internal_auth.sync_channel(self._address, _CHANNEL_OPTIONS) as channel:
                    call = metrics_pb2_grpc.MetricsServiceStub(channel).Watch(self._request)
                    with self._lock:
                        self._call = call
                    if self._closed.is_set():
                        call.cancel()
                    if not _headers_within(call, self._ready_timeout_s):
                        if not self._closed.is_set():
                            log.warning(
                                "metrics watch on %s not confirmed within %g s; reconnecting",
                                self._address,
                                self._ready_timeout_s,
                            )
                    else:
                        self._ready.set()
                        backoff.reset()
                        for response in call:  # a call that ended unconfirmed raises its error here
                            for sample in response.samples:
                                self._deliver(sample)
            except grpc.RpcError as error:
                if self._closed.is_set():
                    return
                code = error.code() if hasattr(error, "code") else None
                log.warning("metrics watch on %s ended (%s); reconnecting", self._address, code)
            except Exception:
                log.exception("metrics watch on %s failed; reconnecting", self._address)
            finally:
                self._ready.clear()
                with self._lock:
                    self._call = None
            if self._closed.wait(backoff.next_s()):
                return

    def _deliver(self, sample: metrics_pb2.Sample) -> None:
        value = MetricSample(sample.name, sample.value, dict(sample.labels), sample.timestamp_unix_ns)
        try:
            self._callback(value)
        except Exception:
            self.callback_errors += 1
            log.exception("on_metric callback failed on %s", sample.name)
        self.received += 1


def _headers_within(call: Any, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the Watch's headers, which the service sends once the watch
    is registered; True when they came (or the call ended: iterating it then raises its
    error). On False the call is cancelled and should be dropped.

    The wait runs on a helper thread: gRPC's sync client was seen to block forever here, on
    a call sent to a service that was shutting down, even after the call was cancelled. Such
    a helper stays blocked (a daemon thread, one per such call) while the subscription goes on.
    """
    arrived = threading.Event()

    def wait() -> None:
        call.initial_metadata()
        arrived.set()

    threading.Thread(target=wait, name="on_metric-headers", daemon=True).start()
    if arrived.wait(timeout_s):
        return True
    call.cancel()
    return False


def on_metric(
    callback: MetricCallback,
    *,
    address: str = "127.0.0.1:50054",
    names: Iterable[str] = (),
    labels: Mapping[str, str] | None = None,
    ready_timeout_s: float = 5.0,
) -> MetricSubscription:
    """Call `callback` with every new sample of `names` (every name when empty) whose labels
    include `labels`, as the metrics service at `address` receives it. A watch the service
    has not confirmed within `ready_timeout_s` is given up and tried again."""
    return MetricSubscription(
        callback, address=address, names=names, labels=labels, ready_timeout_s=ready_timeout_s
    )
