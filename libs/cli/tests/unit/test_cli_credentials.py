"""CLI commands find the internal credential the running `loadmaster up` made (docs/security.md)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadmaster.cli._auth import use_credentials
from loadmaster.cli.run_state import run_state_path, write_run_state
from loadmaster.common import internal_auth, transport
from loadmaster.common.config import load_settings
from loadmaster.common.credentials import ADMIN_HEADER


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.chdir(tmp_path)  # no .loadmaster/ next to the (default) config
    yield
    internal_auth.setup(None)
    transport.setup(transport.Transport())


def test_without_any_secret_calls_go_out_unsigned() -> None:
    use_credentials(load_settings(None))
    assert internal_auth.current() is None


def test_the_running_ups_recorded_secret_is_used(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    secret_file, admin_file = internal_auth.ensure_run_secrets(tmp_path / "elsewhere")
    settings = load_settings(None)
    write_run_state(
        run_state_path(settings.gateway.address),
        {
            "pid": os.getpid(),
            "internal_auth": {"secret_file": str(secret_file), "admin_token_file": str(admin_file)},
        },
    )
    use_credentials(settings)
    credentials = internal_auth.current()
    assert credentials is not None and credentials.identity.service == "cli"
    metadata = dict(credentials.call_metadata("/loadmaster.v1.SchedulerService/SetStrategy"))
    assert metadata[ADMIN_HEADER] == admin_file.read_text().strip()


def test_the_secret_up_made_next_to_the_config_is_used(tmp_path: Path) -> None:
    config = tmp_path / "loadmaster.yaml"
    config.write_text("log_level: INFO\n")
    internal_auth.ensure_run_secrets(tmp_path)
    use_credentials(config)
    assert internal_auth.current() is not None


def test_a_config_naming_a_ca_makes_the_clis_channels_tls(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot checked here\n-----END CERTIFICATE-----\n")
    config = tmp_path / "loadmaster.yaml"
    config.write_text(f"internal_auth:\n  tls_ca_file: {ca}\n")
    use_credentials(config)
    assert transport.current().tls_ca == ca.read_bytes()
    assert transport.channel_credentials() is not None  # aio_channel / sync_channel use it
