"""retry.Backoff (a reconnect loop's delays) and retry_options (gRPC's service config)."""

from __future__ import annotations

import json

import pytest

from loadmaster.common.retry import IDEMPOTENT_CALLS, Backoff, retry_options


def test_backoff_doubles_up_to_its_ceiling_and_starts_over_after_a_reset() -> None:
    backoff = Backoff(first_s=0.1, max_s=0.5)
    assert [backoff.next_s() for _ in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    backoff.reset()
    assert backoff.next_s() == pytest.approx(0.1)


@pytest.mark.parametrize(("first_s", "max_s"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_backoff_refuses_delays_that_are_not_a_range(first_s: float, max_s: float) -> None:
    with pytest.raises(ValueError, match="first_s"):
        Backoff(first_s=first_s, max_s=max_s)


def test_retry_options_name_every_call_with_one_policy() -> None:
    options = dict(retry_options(max_attempts=4, initial_backoff_s=0.05, max_backoff_s=2.0))
    assert options["grpc.enable_retries"] == 1
    (method_config,) = json.loads(options["grpc.service_config"])["methodConfig"]
    assert {(n["service"], n["method"]) for n in method_config["name"]} == set(IDEMPOTENT_CALLS)
    assert method_config["retryPolicy"] == {
        "maxAttempts": 4,
        "initialBackoff": "0.05s",
        "maxBackoff": "2s",
        "backoffMultiplier": 2.0,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }


def test_calls_that_must_not_run_twice_are_not_retried() -> None:
    names = {method for _, method in IDEMPOTENT_CALLS}
    assert not names & {"Release", "Load", "Unload", "Pin", "SetStrategy", "RegisterNode", "Infer"}


@pytest.mark.parametrize("attempts", [1, 6])
def test_retry_options_keep_to_grpcs_limits(attempts: int) -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        retry_options(max_attempts=attempts)
