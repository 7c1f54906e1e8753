"""The CLI's internal credential and transport: commands that call services carry the suite's
credential, over TLS when the config names a CA (docs/security.md)."""

from __future__ import annotations

from pathlib import Path

from loadmaster.cli.run_state import read_run_state, run_state_path
from loadmaster.common import internal_auth, transport
from loadmaster.common.config import InternalAuthSettings, Settings, load_settings
from loadmaster.common.credentials import Identity
from loadmaster.common.service import default_instance_id

__all__ = ["use_credentials"]


def use_credentials(config: Path | Settings | None) -> None:
    """Sign this process's calls with the secret the config names, else the one `loadmaster up`
    made next to it, else the one the running `up` of this gateway address recorded in its run
    state; without any, calls go out as before (a loopback suite without auth). With
    `internal_auth.tls_ca_file` in the config, the channels it opens are TLS, as the services'."""
    settings = config if isinstance(config, Settings) else load_settings(config)
    transport.setup(transport.from_settings(settings))
    identity = Identity("cli", default_instance_id())
    credentials = internal_auth.client_credentials(settings, identity)
    files = read_run_state(run_state_path(settings.gateway.address)).get("internal_auth")
    if credentials is None and isinstance(files, dict) and files.get("secret_file"):
        auth = InternalAuthSettings.model_validate({**settings.internal_auth.model_dump(), **files})
        credentials = internal_auth.credentials_from_settings(
            settings.model_copy(update={"internal_auth": auth}), identity
        )
    internal_auth.setup(credentials, insecure=settings.internal_auth.insecure)
