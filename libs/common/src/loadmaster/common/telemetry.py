"""Telemetry reporter: services record samples on their hot path for the cost of a
dict lookup and two appends; a background task ships them to the metrics service in
batches over one long-lived `Report` stream. When the metrics service is down, samples
are dropped (counted) rather than blocking or growing memory without bound.

Observations are grouped per series (name and label set) as they are recorded, and a
batch carries each series once: its name and labels, then its values and timestamp
deltas packed (`SampleSeries`). One protobuf message per observation cost ~2.6 µs each
to build here and more to parse and ingest at the metrics service, on machines where
that CPU competes with the request path.

Counters (metric_names) are summed per name and label set until the next batch, which
carries one value per series with the sum: the metrics service only ever adds their
increments up, and a sample per event was most of the reporting cost on the request
path (building and writing the batches took a third of the scheduler's CPU under a
stream of small requests; the slowest 2 % of those requests lined up with the flushes).

Every reporter also reports its own process every `process_interval_s` (CPU seconds,
resident memory, open descriptors, start time) and a `build_info` reading with the
service's version, so every service has process metrics and a version in Prometheus. With
them goes `event_loop_lag_ms`: each second, how much later than asked a 10 ms timer fired at
worst, so a loop held by work that belongs elsewhere shows (the gateway's front ends share one).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import operator
import platform
import threading
import time
from collections.abc import AsyncIterator, Mapping
from importlib import metadata

import grpc
import psutil

from loadmaster.common.grpc_client import aio_channel
from loadmaster.common.metric_names import METRICS, MetricKind
from loadmaster.common.retry import Backoff
from loadmaster.v1 import metrics_pb2, metrics_pb2_grpc

__all__ = ["TelemetryReporter"]

log = logging.getLogger(__name__)

# A series is a name and its labels. Observations keep the labels in the order the caller
# gave them: sorting would cost more than the rare duplicate series it saves (the metrics
# service merges label sets in any order). Counters sort them: one sum per series.
_SeriesKey = tuple[str, tuple[tuple[str, str], ...]]
_STARTUP_QUIET_S = 10.0  # after start(), the metrics service being unreachable is logged at debug
_COUNTERS = frozenset(name for name, spec in METRICS.items() if spec.kind is MetricKind.COUNTER)


class _Observations:
    """The values of one series recorded since the last batch, oldest first, and when."""

    __slots__ = ("stamps", "values")

    def __init__(self) -> None:
        self.values: collections.deque[float] = collections.deque()
        self.stamps: collections.deque[int] = collections.deque()

    def take(self, count: int) -> _Observations:
        """Remove the oldest `count` observations and return them."""
        taken = _Observations()
        for _ in range(count):
            taken.values.append(self.values.popleft())
            taken.stamps.append(self.stamps.popleft())
        return taken


def _version(service: str) -> str:
    try:
        return metadata.version(f"loadmaster-{service}")
    except metadata.PackageNotFoundError:
        return "unknown"


class _ProcessReadings:
    """This process's CPU, memory and descriptors, as samples (CPU as increments)."""

    def __init__(self, service: str) -> None:
        self._process = psutil.Process()
        self._cpu_s = 0.0
        self._build = {"version": _version(service), "python": platform.python_version()}

    def record(self, reporter: TelemetryReporter) -> None:
        with self._process.oneshot():
            times = self._process.cpu_times()
            rss = self._process.memory_info().rss
            fds = self._process.num_fds()
            started = self._process.create_time()
        cpu_s = times.user + times.system
        reporter.record("process_cpu_seconds", max(0.0, cpu_s - self._cpu_s))
        self._cpu_s = cpu_s
        reporter.record("process_resident_memory_bytes", float(rss))
        reporter.record("process_open_fds", float(fds))
        reporter.record("process_start_time_seconds", started)
        reporter.record("build_info", 1.0, self._build)


def _deltas(stamps: collections.deque[int]) -> map[int]:
    """The first timestamp, then each one's difference from the one before."""
    return map(operator.sub, stamps, itertools.chain((0,), stamps))


class TelemetryReporter:
    def __init__(
        self,
        service: str,
        instance: str,
        address: str | None,
        *,
        flush_interval_s: float = 0.25,
        max_buffer: int = 100_000,
        max_batch: int = 5_000,
        process_interval_s: float | None = 5.0,
        loop_lag_tick_s: float = 0.1,
    ) -> None:
        self.service = service
        self._loop_lag_tick_s = loop_lag_tick_s
        self.instance = instance
        self._address = address
        self._flush_interval_s = flush_interval_s
        self._max_buffer = max_buffer
        self._max_batch = max_batch
        self._process_interval_s = process_interval_s
        # Guards the pending observations and counts: record() runs on any thread, and a
        # batch takes them as a whole (the lock is never held across I/O).
        self._lock = threading.Lock()
        self._series: dict[_SeriesKey, _Observations] = {}  # non-counter observations, by series
        self._held = 0  # observations in `_series`
        self._counts: dict[_SeriesKey, float] = {}  # counter increments since the last batch
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._process_task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self._closing = False
        self._stream: object | None = None  # the Report call being fed (see _batches)
        self.dropped = 0
        self.sent = 0  # samples in streams that ended cleanly
        self._unconfirmed = 0  # samples written to the current stream
        self._outage = False
        self._quiet_until = 0.0  # (monotonic) a failure before this is the suite still starting

    def record(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        """Queue one sample. Safe from any thread; never blocks on I/O. When `max_buffer`
        samples wait, a new one replaces the oldest waiting sample of its series (or is
        dropped if its series has none), so every series keeps its newest readings."""
        if self._address is None:
            return
        if name in _COUNTERS:
            key = (name, tuple(sorted(labels.items())) if labels else ())
            with self._lock:
                self._counts[key] = self._counts.get(key, 0.0) + value
        else:
            key = (name, tuple(labels.items()) if labels else ())
            stamp = time.time_ns()
            lock = self._lock
            lock.acquire()  # not `with`: its __enter__/__exit__ calls cost a third of this path
            try:
                series = self._series.get(key)  # a series held here has values waiting
                if self._held < self._max_buffer:
                    self._held += 1
                    if series is None:
                        series = self._series[key] = _Observations()
                else:
                    self.dropped += 1
                    if series is None:
                        return
                    series.values.popleft()
                    series.stamps.popleft()
                series.values.append(float(value))
                series.stamps.append(stamp)
            finally:
                lock.release()
        if not self._wake.is_set() and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # loop closed during shutdown
                pass

    def start(self) -> None:
        if self._address is None or self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        # Services start together (`loadmaster up`, compose): the metrics service may not listen
        # yet when the first report leaves. Not an outage worth a warning in that window.
        self._quiet_until = time.monotonic() + _STARTUP_QUIET_S
        self._task = asyncio.create_task(self._run(), name=f"telemetry-{self.service}")
        if self._process_interval_s is not None:
            readings = _ProcessReadings(self.service)
            readings.record(self)  # the first reading at once: a short-lived process has one too
            self._process_task = asyncio.create_task(
                self._report_process(readings, self._process_interval_s), name=f"process-{self.service}"
            )
            self._lag_task = asyncio.create_task(
                self._report_loop_lag(self._loop_lag_tick_s), name=f"loop-lag-{self.service}"
            )

    async def close(self, timeout_s: float = 1.0) -> None:
        """Flush what is buffered (bounded by `timeout_s`) and stop."""
        self._closing = True
        self._wake.set()
        if self._process_task is not None:
            self._process_task.cancel()
        if self._lag_task is not None:
            self._lag_task.cancel()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout_s)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()

    async def _report_process(self, readings: _ProcessReadings, interval_s: float) -> None:
        while not self._closing:
            await asyncio.sleep(interval_s)
            try:
                readings.record(self)
            except Exception:
                log.exception("reading this process's metrics failed")

    async def _report_loop_lag(self, tick_s: float, every_s: float = 1.0) -> None:
        """Once per `every_s`, the longest delay of a `tick_s` timer beyond its due time."""
        loop = asyncio.get_running_loop()
        worst, since = 0.0, loop.time()
        while not self._closing:
            asked = loop.time()
            await asyncio.sleep(tick_s)
            now = loop.time()
            worst = max(worst, now - asked - tick_s)
            if now - since >= every_s:
                self.record("event_loop_lag_ms", worst * 1000)
                worst, since = 0.0, now

    def _pending(self) -> bool:
        return bool(self._series or self._counts)

    def _take(self) -> tuple[dict[_SeriesKey, float], dict[_SeriesKey, _Observations]]:
        """The summed counters and up to `max_batch` observations, oldest series first; a
        series with more than the room left gives its oldest ones."""
        with self._lock:
            counts, self._counts = self._counts, {}
            if self._held <= self._max_batch:
                taken, self._series, self._held = self._series, {}, 0
                return counts, taken
            taken = {}
            room = self._max_batch
            for key, series in self._series.items():
                if len(series.values) > room:
                    taken[key] = series.take(room)
                    break
                taken[key] = series
                room -= len(series.values)
                if not room:
                    break
            for key, series in taken.items():
                if self._series[key] is series:
                    del self._series[key]
            self._held -= self._max_batch
            return counts, taken

    def _take_batch(self) -> metrics_pb2.ReportRequest:
        """The summed counters (one value per series), then observations up to `max_batch`,
        each series once; built outside the lock so record() never waits on it."""
        counts, taken = self._take()
        batch = metrics_pb2.ReportRequest(service=self.service, instance=self.instance)
        add = batch.series.add
        now = time.time_ns()
        for (name, labels), total in counts.items():
            add(name=name, labels=dict(labels), values=(total,), timestamp_deltas_ns=(now,))
        for (name, labels), series in taken.items():
            add(
                name=name,
                labels=dict(labels),
                values=series.values,
                timestamp_deltas_ns=_deltas(series.stamps),
            )
        return batch

    async def _batches(self, stream: object) -> AsyncIterator[metrics_pb2.ReportRequest]:
        """A batch per flush interval: what was recorded while one was being written waits
        for the next interval too (a steady stream would otherwise cost a tiny batch and a
        stream write per request). A backlog of full batches, and a close, go out at once.

        `stream` is the Report call this feeds. gRPC keeps reading a failed call's iterator
        in a task of its own, so once the call has ended (`self._stream` moved on) this one
        stops instead of taking the next batch: its write would fail and the batch be lost.
        (A service started before the metrics service left one such iterator per failed
        attempt, and each swallowed a later batch: the gpu-broker's gauges, recorded every
        15 s, went missing for a minute.)"""
        while stream is self._stream:
            if not self._pending():
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self._closing and self._held < self._max_batch:
                await asyncio.sleep(self._flush_interval_s)  # gather a batch
            if stream is not self._stream:
                return
            batch = self._take_batch()
            self._unconfirmed += sum(len(series.values) for series in batch.series)
            yield batch

    async def _run(self) -> None:
        assert self._address is not None
        backoff = Backoff(first_s=0.1, max_s=5.0)
        while not (self._closing and not self._pending()):
            try:
                async with aio_channel(self._address) as channel:
                    stub = metrics_pb2_grpc.MetricsServiceStub(channel)
                    self._unconfirmed = 0
                    stream = self._stream = object()
                    try:
                        await stub.Report(self._batches(stream))
                    finally:
                        self._stream = None
                self.sent += self._unconfirmed
                self._unconfirmed = 0
                self._outage = False
                if self._closing:
                    return
                log.info("metrics service at %s ended the report stream; reconnecting", self._address)
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as error:
                with self._lock:
                    dropped = self._held + len(self._counts) + self._unconfirmed
                    self._series.clear()
                    self._held = 0
                    self._counts.clear()
                    self.dropped += dropped
                self._unconfirmed = 0
                # Once per outage at warning level; the retries after it at debug.
                starting = time.monotonic() < self._quiet_until
                log.log(
                    logging.DEBUG if self._outage or starting else logging.WARNING,
                    "metrics service at %s unreachable (%s); dropped %d samples",
                    self._address,
                    error.code().name,
                    dropped,
                )
                self._outage = not starting  # after the start window: the next failure warns
            except Exception:
                log.exception("telemetry reporter failed; restarting")
            if self._closing:
                return
            await asyncio.sleep(backoff.next_s())
