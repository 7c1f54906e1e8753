"""The CLI's internal credential: commands that call services carry the suite's (docs/security.md)."""

from __future__ import annotations

from pathlib import Path

from loadmaster.common import internal_auth
from loadmaster.common.config import Settings, load_settings
from loadmaster.common.service import default_instance_id

__all__ = ["use_credentials"]


def use_credentials(config: Path | Settings | None) -> None:
    """Sign this process's calls with the secret the config names, or the one `loadmaster up`
    made next to it; without either, calls go out as before (a loopback suite without auth)."""
    settings = config if isinstance(config, Settings) else load_settings(config)
    internal_auth.setup_client(settings, internal_auth.Identity("cli", default_instance_id()))
