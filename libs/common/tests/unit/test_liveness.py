"""The liveness contract (docs/liveness.md): every link that carries requests or leases notices
a silent peer within the documented 2 s, with room to spare, and the options every gRPC
server and channel gets say the same numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadmaster.common.grpc_client import CLIENT_OPTIONS
from loadmaster.common.grpc_server import GRPC_OPTIONS
from loadmaster.common.liveness import GRPC_CLIENT_PING_FLOOR_S, LIVENESS, LinkLiveness

DOCUMENTED_S = 2.0  # docs/liveness.md, docs/compose.md, tests/compose/test_compose_up.py
MARGIN_S = 0.15  # a loop tick, the re-grant's round trip, a reply: what follows the detection
LOOP_STALL_S = 0.3  # the longest event-loop stall seen on the 2-core test machines


def test_the_promise_is_the_documented_one() -> None:
    assert LIVENESS.detect_within_s == DOCUMENTED_S


def test_every_link_notices_a_silent_peer_within_the_promise_with_room_to_spare() -> None:
    bounds = {
        "scheduler <- silent worker or gateway (gRPC keepalive, server side)": LIVENESS.grpc_server_bound_s,
        "worker, gateway, lease keeper <- silent server (gRPC keepalive, client side)": (
            LIVENESS.grpc_client_bound_s
        ),
        "gateway <- silent worker on its data link (ZMTP heartbeats)": LIVENESS.zmtp_bound_s,
        "gateway <- worker gone before its data link connected": LIVENESS.connect_within_s,
    }
    late = {link: s for link, s in bounds.items() if s > DOCUMENTED_S - MARGIN_S}
    assert late == {}, f"beyond {DOCUMENTED_S} s - {MARGIN_S} s: {late}"


def test_requests_held_by_a_lost_worker_are_re_granted_or_failed_within_the_promise() -> None:
    assert LIVENESS.in_flight_bound_s <= DOCUMENTED_S - MARGIN_S
    # ... also when only the gateway notices (a cut between it and one worker).
    assert LIVENESS.gateway_fallback_s <= DOCUMENTED_S - MARGIN_S
    # The gateway waits for the scheduler's re-grant no longer than the scheduler can take to
    # notice after it (so its fallback is rarely the one that answers) ...
    assert LIVENESS.lost_grace_s <= LIVENESS.grpc_server_bound_s
    # ... and refuses a lost endpoint until the scheduler has noticed too.
    assert LIVENESS.refuse_lost_s >= LIVENESS.grpc_server_bound_s


def test_a_busy_but_live_peer_is_not_dropped() -> None:
    """Probes are answered by native threads, but a host as loaded as the test machines still
    delays those by far less than a loop stall; every timeout is well above that."""
    assert LIVENESS.answer_within_s >= 2 * LOOP_STALL_S
    assert LIVENESS.connect_within_s >= 2 * LOOP_STALL_S


def test_the_client_side_bound_counts_grpc_s_own_ping_floor() -> None:
    fast = replace(LIVENESS, grpc_probe_every_s=0.5)
    assert fast.grpc_client_bound_s == GRPC_CLIENT_PING_FLOOR_S + LIVENESS.answer_within_s
    assert fast.grpc_client_bound_s == LIVENESS.grpc_client_bound_s  # probing faster buys nothing


def test_a_live_link_s_keepalive() -> None:
    values = dict(LIVENESS.grpc_options())
    assert values["grpc.keepalive_time_ms"] == 1000
    # grpcio 1.85 times a keepalive ping's answer by the ping timeout (60 s unless set).
    assert values["grpc.http2.ping_timeout_ms"] == values["grpc.keepalive_timeout_ms"] == 800
    # Pings only while a call is open: a session always; a lease channel while renewing.
    assert values["grpc.keepalive_permit_without_calls"] == 0
    assert values["grpc.http2.max_pings_without_data"] == 0


@pytest.mark.parametrize("options", [GRPC_OPTIONS, CLIENT_OPTIONS], ids=["servers", "channels"])
def test_every_other_server_and_channel_probes_gently_and_takes_a_live_link_s_pings(
    options: list[tuple[str, object]],
) -> None:
    values = dict(options)
    assert values["grpc.keepalive_time_ms"] == 10_000
    assert values["grpc.http2.ping_timeout_ms"] == values["grpc.keepalive_timeout_ms"] == 5_000
    assert values["grpc.keepalive_permit_without_calls"] == 0  # an idle channel costs nothing
    # Any server takes the pings a live link sends (at most once a second) without strikes.
    live_ms = dict(LIVENESS.grpc_options())["grpc.keepalive_time_ms"]
    assert values["grpc.http2.min_ping_interval_without_data_ms"] <= live_ms // 2
    assert dict(LIVENESS.grpc_options())["grpc.http2.min_ping_interval_without_data_ms"] <= live_ms // 2


def test_zmtp_heartbeats_say_the_same_in_milliseconds() -> None:
    assert (LIVENESS.heartbeat_ivl_ms, LIVENESS.heartbeat_timeout_ms) == (500, 800)
    assert LinkLiveness(zmtp_probe_every_s=0.25, answer_within_s=0.6).heartbeat_timeout_ms == 600
