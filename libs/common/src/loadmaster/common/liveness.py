"""How fast a silent peer is noticed: the one place every link's probe timing comes from.

A peer can vanish without a goodbye: its process frozen (SIGSTOP, a hung host), its
container or host gone, its network cut. Nothing is closed then, so no link ends on its
own; only a probe that goes unanswered finds it. The suite promises that every link that
carries requests or leases notices such a peer within `detect_within_s` (2 s,
docs/liveness.md), and that a request held by a lost worker is answered or re-granted
within that time too. The links and their probes:

- gRPC streams and channels (the worker's and the gateway's sessions with the scheduler,
  in both directions; the lease keeper's channel to the gpu-broker; reports to metrics):
  HTTP/2 keepalive pings every `probe_every_s` (`grpc_options`), each to be answered within
  `answer_within_s`. gRPC core itself sends a client's pings at most once a second
  (`GRPC_CLIENT_PING_FLOOR_S`), so a client notices a frozen server later than a server
  notices a frozen client (`grpc_client_bound_s` against `grpc_server_bound_s`).
- The gateway's ZMQ data links to the workers' data ports: ZMTP heartbeats, a PING every
  `probe_every_s` and the link dropped when nothing came back within `answer_within_s`
  (`zmtp_bound_s`); a new link must connect (name resolved, TCP and ZMTP handshake) within
  `connect_within_s`; a lost link's endpoint is refused for `refuse_lost_s` (by then the
  scheduler has noticed the worker too and grants elsewhere).
- Requests on a lost worker: the scheduler re-queues what it granted there when the
  worker's session ends (`grpc_server_bound_s`); the gateway, which may notice first, gives
  it `lost_grace_s` to do so, then fails them as retryable itself (`in_flight_bound_s`).

Why these numbers: the probes are answered by native threads (libzmq's I/O thread,
gRPC core's event engine), not by a service's event loop, so a loop busy for seconds
still answers them (docs/liveness.md has the measurement). `answer_within_s` only has to
cover scheduling delay of a native thread on a loaded host and a LAN round trip; 0.8 s is
more than twice the longest loop stall seen on the 2-core test machines (100-300 ms).
Peers across a slow WAN (a ping's round trip near `answer_within_s`) would be dropped:
the suite's internal links are meant for one data centre.

Public front ends are not held to this: the gateway's KServe gRPC port pings its clients
as gently as before (`PUBLIC_SERVER_OPTIONS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["GRPC_CLIENT_PING_FLOOR_S", "LIVENESS", "PUBLIC_SERVER_OPTIONS", "LinkLiveness"]

# gRPC core (chttp2) sends a client's pings at least a second apart, whatever its keepalive
# time (its trace says "Ping delayed: not enough time elapsed since last ping ... minimum
# wait: 1000ms" with keepalive_time_ms 500).
GRPC_CLIENT_PING_FLOOR_S = 1.0


@dataclass(frozen=True, slots=True)
class LinkLiveness:
    detect_within_s: float = 2.0  # the promise (docs/liveness.md, docs/compose.md)
    probe_every_s: float = 0.5  # gRPC keepalive time; ZMTP heartbeat interval
    answer_within_s: float = 0.8  # a probe's answer: gRPC ping ack, ZMTP PONG (or any message)
    connect_within_s: float = 1.0  # a new data link: resolve, TCP connect, ZMTP handshake
    lost_grace_s: float = 0.5  # the gateway waits this long for the scheduler's re-grant

    @property
    def grpc_server_bound_s(self) -> float:
        """Worst time for a gRPC server (the scheduler) to notice a silent client."""
        return self.probe_every_s + self.answer_within_s

    @property
    def grpc_client_bound_s(self) -> float:
        """Worst time for a gRPC client (a worker, a gateway, a lease keeper) to notice a
        silent server: its pings go at most once per `GRPC_CLIENT_PING_FLOOR_S`."""
        return max(self.probe_every_s, GRPC_CLIENT_PING_FLOOR_S) + self.answer_within_s

    @property
    def zmtp_bound_s(self) -> float:
        """Worst time for the gateway to notice a silent worker on its data link: the last
        message came just after a PING, the next PING goes `probe_every_s` later and its
        answer is given up `answer_within_s` after that."""
        return self.probe_every_s + self.answer_within_s

    @property
    def refuse_lost_s(self) -> float:
        """How long sends to a lost data link's endpoint fail at once: until the scheduler
        has certainly noticed the worker as well (then it grants elsewhere)."""
        return self.grpc_server_bound_s

    @property
    def in_flight_bound_s(self) -> float:
        """Worst time from a worker going silent to its requests being re-granted or failed:
        the scheduler re-queues them when it notices; else the gateway fails them
        `lost_grace_s` after it noticed, or `connect_within_s` after sending them on a new
        link that never connected."""
        gateway = max(self.zmtp_bound_s, self.connect_within_s) + self.lost_grace_s
        return min(self.grpc_server_bound_s, gateway) if self.lost_grace_s else gateway

    @property
    def gateway_fallback_s(self) -> float:
        """Worst time via the gateway alone (the scheduler never noticing: a cut between the
        gateway and a worker only)."""
        return max(self.zmtp_bound_s, self.connect_within_s) + self.lost_grace_s

    @property
    def heartbeat_ivl_ms(self) -> int:
        return round(self.probe_every_s * 1000)

    @property
    def heartbeat_timeout_ms(self) -> int:
        return round(self.answer_within_s * 1000)

    def grpc_options(self) -> list[tuple[str, Any]]:
        """The keepalive channel arguments, for servers and clients alike."""
        probe_ms = round(self.probe_every_s * 1000)
        answer_ms = round(self.answer_within_s * 1000)
        return [
            ("grpc.keepalive_time_ms", probe_ms),
            # gRPC core before ~1.6x reads the keepalive timeout; later ones take a keepalive
            # ping's deadline from the ping timeout (default 60 s): both are set.
            ("grpc.keepalive_timeout_ms", answer_ms),
            ("grpc.http2.ping_timeout_ms", answer_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # A server takes a client's pings up to twice as often as they are sent before
            # it counts a strike (two strikes: GOAWAY "too_many_pings").
            ("grpc.http2.min_ping_interval_without_data_ms", probe_ms // 2),
        ]


LIVENESS = LinkLiveness()

# The gateway's public gRPC port (KServe): its clients may sit across slow networks, and
# fast detection of a vanished client frees nothing that matters. It still accepts pings as
# often as the suite's own clients send them.
PUBLIC_SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
]
