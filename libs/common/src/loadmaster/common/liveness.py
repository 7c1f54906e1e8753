"""How fast a silent peer is noticed: the one place every link's probe timing comes from.

A peer can vanish without a goodbye: its process frozen (SIGSTOP, a hung host), its
container or host gone, its network cut. Nothing is closed then, so no link ends on its
own; only a probe that goes unanswered finds it. The suite promises that every link that
carries requests or leases notices such a peer within `detect_within_s` (2 s,
docs/liveness.md), and that a request held by a lost worker is answered or re-granted
within that time too. The links and their probes:

- The live gRPC links (`LinkLiveness.grpc_options`): the scheduler's server (the worker's
  and the gateway's sessions with it), the worker's and the gateway's session channels to
  it, and the lease keeper's channel to the gpu-broker. HTTP/2 keepalive pings every
  `grpc_probe_every_s`, each to be answered within `answer_within_s`, and only while a call
  is open on the connection (a session always is; a lease channel while a renewal is out),
  so the scheduler does not ping the gateway's catalog channel and an idle lease channel
  costs nothing. gRPC core sends a client's pings at most once a second
  (`GRPC_CLIENT_PING_FLOOR_S`).
- The gateway's ZMQ data links to the workers' data ports: ZMTP heartbeats, a PING every
  `zmtp_probe_every_s` and the link dropped when nothing came back within `answer_within_s`
  (`zmtp_bound_s`); a new link must connect (name resolved, TCP and ZMTP handshake) within
  `connect_within_s`; a lost link's endpoint is refused for `refuse_lost_s` (by then the
  scheduler has noticed the worker too and grants elsewhere).
- Requests on a lost worker: the scheduler re-queues what it granted there when the
  worker's session ends (`grpc_server_bound_s`); the gateway, which may notice first, gives
  it `lost_grace_s` to do so, then fails them as retryable itself (`in_flight_bound_s`).
- Every other gRPC server and channel (reports to metrics, the gateway's catalog and admin
  calls, the CLI, the public KServe port) probes gently (`DEFAULT_KEEPALIVE_OPTIONS`: every
  10 s while a call is open, 5 s to answer). A gRPC keepalive ping costs each side about 22
  thread wake-ups (gRPC core's event engine; a ZMTP heartbeat costs 2-4): probing every
  connection at the live pace took the idle suite from 0.8 % to 1.35-1.85 % of a core, past
  its 1 % budget (docs/liveness.md). Every server accepts pings at the live pace.

Why these numbers: the probes are answered by native threads (libzmq's I/O thread,
gRPC core's event engine), not by a service's event loop, so a loop busy for seconds
still answers them (docs/liveness.md has the measurement). `answer_within_s` only has to
cover scheduling delay of a native thread on a loaded host and a LAN round trip; 0.8 s is
more than twice the longest loop stall seen on the 2-core test machines (100-300 ms).
Peers across a slow WAN (a ping's round trip near `answer_within_s`) would be dropped:
the suite's internal links are meant for one data centre.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_KEEPALIVE_OPTIONS", "GRPC_CLIENT_PING_FLOOR_S", "LIVENESS", "LinkLiveness"]

# gRPC core (chttp2) sends a client's pings at least a second apart, whatever its keepalive
# time (its trace says "Ping delayed: not enough time elapsed since last ping ... minimum
# wait: 1000ms" with keepalive_time_ms 500).
GRPC_CLIENT_PING_FLOOR_S = 1.0


@dataclass(frozen=True, slots=True)
class LinkLiveness:
    detect_within_s: float = 2.0  # the promise (docs/liveness.md, docs/compose.md)
    grpc_probe_every_s: float = 1.0  # a live gRPC link's keepalive time
    zmtp_probe_every_s: float = 0.5  # the data links' ZMTP heartbeat interval
    answer_within_s: float = 0.8  # a probe's answer: gRPC ping ack, ZMTP PONG (or any message)
    connect_within_s: float = 1.0  # a new data link: resolve, TCP connect, ZMTP handshake
    lost_grace_s: float = 0.5  # the gateway waits this long for the scheduler's re-grant

    @property
    def grpc_server_bound_s(self) -> float:
        """Worst time for a gRPC server (the scheduler) to notice a silent client."""
        return self.grpc_probe_every_s + self.answer_within_s

    @property
    def grpc_client_bound_s(self) -> float:
        """Worst time for a gRPC client (a worker, a gateway, a lease keeper) to notice a
        silent server: its pings go at most once per `GRPC_CLIENT_PING_FLOOR_S`."""
        return max(self.grpc_probe_every_s, GRPC_CLIENT_PING_FLOOR_S) + self.answer_within_s

    @property
    def zmtp_bound_s(self) -> float:
        """Worst time for the gateway to notice a silent worker on its data link: the last
        message came just after a PING, the next PING goes `zmtp_probe_every_s` later and its
        answer is given up `answer_within_s` after that."""
        return self.zmtp_probe_every_s + self.answer_within_s

    @property
    def refuse_lost_s(self) -> float:
        """How long sends to a lost data link's endpoint fail at once: until the scheduler
        has certainly noticed the worker as well (then it grants elsewhere)."""
        return self.grpc_server_bound_s

    @property
    def gateway_fallback_s(self) -> float:
        """Worst time for the gateway alone to fail a lost worker's calls (retryable): it
        noticed the data link's loss (or a new link never connected), then waited
        `lost_grace_s` for the scheduler's re-grant. (A cut between the gateway and one worker
        only: the scheduler never notices.)"""
        return max(self.zmtp_bound_s, self.connect_within_s) + self.lost_grace_s

    @property
    def in_flight_bound_s(self) -> float:
        """Worst time from a worker going silent to its requests being re-granted or failed:
        the scheduler re-queues them when it notices, the gateway fails them at
        `gateway_fallback_s`, whichever comes first."""
        return min(self.grpc_server_bound_s, self.gateway_fallback_s)

    @property
    def heartbeat_ivl_ms(self) -> int:
        return round(self.zmtp_probe_every_s * 1000)

    @property
    def heartbeat_timeout_ms(self) -> int:
        return round(self.answer_within_s * 1000)

    def grpc_options(self) -> list[tuple[str, Any]]:
        """The keepalive channel arguments of a live link, for its server and its client."""
        probe_ms = round(self.grpc_probe_every_s * 1000)
        answer_ms = round(self.answer_within_s * 1000)
        return [
            ("grpc.keepalive_time_ms", probe_ms),
            # gRPC core before ~1.6x reads the keepalive timeout; later ones take a keepalive
            # ping's deadline from the ping timeout (default 60 s): both are set.
            ("grpc.keepalive_timeout_ms", answer_ms),
            ("grpc.http2.ping_timeout_ms", answer_ms),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 0),
            *_accept_pings(probe_ms),
        ]


def _accept_pings(probe_ms: int) -> list[tuple[str, Any]]:
    # A server takes a client's pings up to twice as often as a live link sends them before it
    # counts a strike (two strikes: GOAWAY "too_many_pings").
    return [("grpc.http2.min_ping_interval_without_data_ms", probe_ms // 2)]


LIVENESS = LinkLiveness()

# Every other gRPC server and channel: a silent peer noticed within 15 s; a server that takes
# the live links' pings.
DEFAULT_KEEPALIVE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    *_accept_pings(round(LIVENESS.grpc_probe_every_s * 1000)),
]
