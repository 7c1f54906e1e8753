"""The credential itself: what verifies, what does not, and which binds need it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadmaster.common import internal_auth
from loadmaster.common.config import load_settings
from loadmaster.common.credentials import (
    ADMIN_HEADER,
    AUTH_HEADER,
    ENVELOPE_KEY,
    IDENTITY_HEADER,
    SUITE_SERVICES,
    Credentials,
    Identity,
)
from loadmaster.common.errors import PermissionDeniedError, UnauthenticatedError
from loadmaster.common.internal_auth import InsecureBindError

SECRET = b"s" * 32
SET_STRATEGY = "/loadmaster.v1.SchedulerService/SetStrategy"
LIST_WORKERS = "/loadmaster.v1.SchedulerService/ListWorkers"


class Clock:
    def __init__(self) -> None:
        self.ns = 1_700_000_000 * 10**9

    def __call__(self) -> int:
        return self.ns


@pytest.fixture
def clock() -> Clock:
    return Clock()


def creds(clock: Clock, who: str = "gateway/g1", secret: bytes = SECRET, **kwargs: str) -> Credentials:
    return Credentials(secret, Identity.parse(who), now_ns=clock, max_clock_skew_s=30, **kwargs)


@pytest.fixture(autouse=True)
def _no_process_credentials() -> Iterator[None]:
    yield
    internal_auth.setup(None)


def test_a_call_verifies_as_its_identity_and_only_for_its_method(clock: Clock) -> None:
    metadata = dict(creds(clock).call_metadata(LIST_WORKERS))
    assert creds(clock, "scheduler/s1").verify_call(metadata, LIST_WORKERS) == Identity("gateway", "g1")
    with pytest.raises(UnauthenticatedError, match="does not verify"):
        creds(clock, "scheduler/s1").verify_call(metadata, "/loadmaster.v1.SchedulerService/GetQueues")


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.pop(AUTH_HEADER),
        lambda m: m.pop(IDENTITY_HEADER),
        lambda m: m.update({IDENTITY_HEADER: "gpu-broker/b1"}),  # claims another identity
        lambda m: m.update({AUTH_HEADER: m[AUTH_HEADER][:-1] + "0"}),
        lambda m: m.update({AUTH_HEADER: "x.y"}),
        lambda m: m.update({AUTH_HEADER: m[AUTH_HEADER][:-1] + "é"}),  # not ASCII
    ],
)
def test_a_missing_forged_or_tampered_credential_is_refused(clock: Clock, change: object) -> None:
    metadata = dict(creds(clock).call_metadata(LIST_WORKERS))
    change(metadata)  # type: ignore[operator]
    with pytest.raises(UnauthenticatedError):
        creds(clock).verify_call(metadata, LIST_WORKERS)


def test_another_secret_does_not_verify(clock: Clock) -> None:
    metadata = dict(creds(clock, secret=b"t" * 32).call_metadata(LIST_WORKERS))
    with pytest.raises(UnauthenticatedError):
        creds(clock).verify_call(metadata, LIST_WORKERS)


def test_a_credential_outside_the_skew_window_is_refused(clock: Clock) -> None:
    metadata = dict(creds(clock).call_metadata(LIST_WORKERS))
    clock.ns += 31 * 10**9
    with pytest.raises(UnauthenticatedError, match="clock-skew"):
        creds(clock).verify_call(metadata, LIST_WORKERS)


def test_admin_methods_need_the_admin_token_when_one_is_configured(clock: Clock) -> None:
    token = "admin-token-1"
    checker = creds(clock, "scheduler/s1", admin_sha256=hashlib.sha256(token.encode()).hexdigest())
    service = dict(creds(clock).call_metadata(SET_STRATEGY))
    with pytest.raises(PermissionDeniedError, match="admin credential"):
        checker.verify_call(service, SET_STRATEGY)
    admin = dict(creds(clock, admin_token=token).call_metadata(SET_STRATEGY))
    assert checker.verify_call(admin, SET_STRATEGY) == Identity("gateway", "g1")
    assert ADMIN_HEADER not in dict(creds(clock, admin_token=token).call_metadata(LIST_WORKERS))


def test_a_data_port_envelope_verifies_once(clock: Clock) -> None:
    worker = creds(clock, "model-pool/w1")
    metadata: dict[str, str] = {}
    creds(clock).sign_envelope(metadata, "r1")
    assert worker.verify_envelope(metadata, "r1") == Identity("gateway", "g1")
    with pytest.raises(UnauthenticatedError, match="replayed"):
        worker.verify_envelope(metadata, "r1")
    with pytest.raises(UnauthenticatedError, match="does not verify"):
        worker.verify_envelope(dict(metadata), "r2")  # moved onto another request
    with pytest.raises(UnauthenticatedError, match="no internal credential"):
        worker.verify_envelope({}, "r3")
    signed: dict[str, str] = {}
    creds(clock).sign_envelope(signed, "r4")
    signed[ENVELOPE_KEY] = signed[ENVELOPE_KEY][:-1] + "ü"  # a refusal, not a crash
    with pytest.raises(UnauthenticatedError, match="does not verify"):
        worker.verify_envelope(signed, "r4")


def test_the_replay_memory_forgets_what_the_window_already_refuses(clock: Clock) -> None:
    worker = creds(clock, "model-pool/w1")
    for index in range(100):
        metadata: dict[str, str] = {}
        creds(clock).sign_envelope(metadata, f"r{index}")
        worker.verify_envelope(metadata, f"r{index}")
        clock.ns += 10**9
    assert len(worker._seen) <= 61  # bounded by the window, not by the traffic


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1:50051", "localhost:1", "[::1]:2", "tcp://127.0.0.1:*", "ipc:///tmp/x", "unix:/tmp/y"],
)
def test_loopback_and_local_binds_need_no_auth(address: str) -> None:
    internal_auth.check_listen("svc", address)


@pytest.mark.parametrize(
    "address", ["0.0.0.0:50051", "[::]:1", "tcp://*:5556", "tcp://10.0.0.5:1", "myhost:2"]
)
def test_a_wider_bind_without_auth_is_refused_unless_insecure(address: str, clock: Clock) -> None:
    with pytest.raises(
        InsecureBindError, match=r"svc: refusing to listen on .* internal_auth\.insecure: true"
    ):
        internal_auth.check_listen("svc", address)
    internal_auth.setup(None, insecure=True)
    internal_auth.check_listen("svc", address)
    internal_auth.setup(creds(clock))
    internal_auth.check_listen("svc", address)


def test_settings_read_the_secret_and_admin_token_files(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("0123456789abcdef0123456789abcdef\n")
    (tmp_path / "admin").write_text("admin-1\n")
    config = tmp_path / "loadmaster.yaml"
    config.write_text("internal_auth:\n  secret_file: secret\n  admin_token_file: admin\n")
    settings = load_settings(config)
    made = internal_auth.credentials_from_settings(settings, Identity("cli", "c1"))
    assert made is not None
    metadata = dict(made.call_metadata(SET_STRATEGY))
    assert metadata[ADMIN_HEADER] == "admin-1"
    assert made.verify_call(metadata, SET_STRATEGY) == Identity("cli", "c1")
    assert internal_auth.credentials_from_settings(load_settings(None), Identity("cli", "c1")) is None


def test_an_identity_key_speaks_for_its_identity_only(clock: Clock) -> None:
    suite = creds(clock, "scheduler/s1")
    line = suite.identity_key(Identity("trainer", "job-7"))
    job = Credentials.from_identity_key(line, now_ns=clock)
    assert job.identity == Identity("trainer", "job-7")
    assert suite.verify_call(dict(job.call_metadata(LIST_WORKERS)), LIST_WORKERS) == Identity(
        "trainer", "job-7"
    )
    forged = dict(job.call_metadata(LIST_WORKERS))
    forged[IDENTITY_HEADER] = "model-pool/w1"  # the key cannot claim another identity
    with pytest.raises(UnauthenticatedError):
        suite.verify_call(forged, LIST_WORKERS)
    assert not job.can_verify
    with pytest.raises(RuntimeError, match="identity key"):
        job.with_identity(Identity("model-pool", "w1"))
    with pytest.raises(ValueError, match="not an identity key"):
        Credentials.from_identity_key("lmid1:trainer/job-7:abc")


def test_an_identity_key_in_the_secret_file_makes_identity_bound_credentials(
    tmp_path: Path, clock: Clock
) -> None:
    (tmp_path / "job.key").write_text(creds(clock).identity_key(Identity("trainer", "job-9")) + "\n")
    config = tmp_path / "loadmaster.yaml"
    config.write_text("internal_auth:\n  secret_file: job.key\n")
    made = internal_auth.credentials_from_settings(load_settings(config), Identity("cli", "ignored"))
    assert made is not None and made.identity == Identity("trainer", "job-9")
    internal_auth.setup(made)
    with pytest.raises(RuntimeError, match="needs the suite secret"):
        internal_auth.server_interceptors()


def test_refusals_are_logged_at_a_bounded_rate(caplog: pytest.LogCaptureFixture) -> None:
    limit = internal_auth._RefusalLog(per_s=3, monotonic=lambda: 100.0)  # all within one second
    with caplog.at_level("WARNING", logger=internal_auth.__name__):
        for index in range(20):
            limit(
                "/loadmaster.v1.SchedulerService/SetStrategy",
                f"ipv4:127.0.0.1:{index}",
                "",
                "no internal credential",
            )
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[0] == (
        "refused /loadmaster.v1.SchedulerService/SetStrategy from ipv4:127.0.0.1:0 (identity: none): no internal credential"
    )


def test_identity_keys_are_not_issued_for_suite_services_and_reserved_calls_check_the_service(
    clock: Clock,
) -> None:
    suite = creds(clock, "scheduler/s1")
    for service in SUITE_SERVICES:
        with pytest.raises(ValueError, match="outside the suite"):
            suite.identity_key(Identity(service, "x"))
    register = "/loadmaster.v1.SchedulerService/WorkerSession"
    worker = dict(creds(clock, "model-pool/w1").call_metadata(register))
    assert suite.verify_call(worker, register) == Identity("model-pool", "w1")
    job = Credentials.from_identity_key(suite.identity_key(Identity("trainer", "job-7")), now_ns=clock)
    with pytest.raises(PermissionDeniedError, match="only model-pool may call"):
        suite.verify_call(dict(job.call_metadata(register)), register)
