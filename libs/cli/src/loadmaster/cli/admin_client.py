"""The gateway's admin API (`/admin/v1/...`) for the `keys`, `guardrails`, `config`,
`scheduler use` and `models pin` verbs (docs/admin.md).

The gateway is the config's (`gateway.http_host:http_port`; a wildcard host is reached on
127.0.0.1) unless `--gateway URL` names one. The credential is `--api-key` (or
`$LOADMASTER_API_KEY`: a key with the admin scope), else the suite's admin credential: the
config's `internal_auth.admin_token(_file)`, else the one `loadmaster up` made next to the
config, else the one the running `up` of this gateway address recorded. Without any, calls go
out bare (a suite that does not require keys).

Errors end the command with the gateway's message: exit 2 for a refused value or something
not found (400, 404), 1 for the rest (401, 403, 409, 5xx, gateway unreachable).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.text import Text

from loadmaster.cli._config import EXIT_FAILURE, EXIT_USAGE, settings_from
from loadmaster.cli.run_state import read_run_state, run_state_path
from loadmaster.common.config import Settings
from loadmaster.common.internal_auth import RUN_DIR

__all__ = [
    "AdminClient",
    "AdminError",
    "ApiKeyOption",
    "GatewayOption",
    "admin_client",
    "admin_token",
    "fail",
]

GatewayOption = Annotated[
    str | None,
    typer.Option(
        "--gateway", help="the gateway's HTTP URL (default: gateway.http_host:http_port of the config)"
    ),
]
ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="LOADMASTER_API_KEY",
        help="an API key with the admin scope (default: the suite's admin credential)",
        show_default=False,
    ),
]
_TIMEOUT_S = 15.0
errors = Console(stderr=True, highlight=False)


class AdminError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def admin_token(settings: Settings) -> str:
    """The suite's admin credential, if this config or its running suite has one."""
    auth = settings.internal_auth
    if auth.admin_token is not None:
        return auth.admin_token.get_secret_value()
    candidates: list[Path] = []
    if auth.admin_token_file is not None:
        path = auth.admin_token_file
        candidates.append(path if path.is_absolute() else settings.config_dir / path)
    candidates.append(settings.config_dir / RUN_DIR / "admin.token")
    recorded = read_run_state(run_state_path(settings.gateway.address)).get("internal_auth")
    if isinstance(recorded, dict) and isinstance(recorded.get("admin_token_file"), str):
        candidates.append(Path(recorded["admin_token_file"]))
    for path in candidates:
        try:
            token = path.read_text().strip()
        except OSError:
            continue
        if token:
            return token
    return ""


def gateway_url(settings: Settings) -> str:
    host = settings.gateway.http_host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.gateway.http_port}"


class AdminClient:
    def __init__(self, base_url: str, token: str) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=_TIMEOUT_S)

    def call(self, method: str, path: str, *, body: Any = None, params: dict[str, str] | None = None) -> Any:
        try:
            reply = self._http.request(method, path, json=body, params=params)
        except httpx.HTTPError as error:
            raise AdminError(0, f"gateway at {self.base_url} unreachable: {error}") from None
        try:
            document = reply.json()
        except ValueError:
            document = {"error": reply.text.strip() or reply.reason_phrase}
        if reply.status_code >= 400:
            message = document.get("error") if isinstance(document, dict) else None
            raise AdminError(reply.status_code, str(message or document))
        return document

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def admin_client(config: Path | None, gateway: str | None, api_key: str | None) -> AdminClient:
    settings = settings_from(config)
    return AdminClient(gateway or gateway_url(settings), api_key or admin_token(settings))


def fail(error: AdminError) -> typer.Exit:
    """Print the gateway's message on stderr; the exit to raise."""
    errors.print(Text.assemble(("error: ", "red"), error.message), soft_wrap=True)
    return typer.Exit(EXIT_USAGE if error.status in (400, 404, 422) else EXIT_FAILURE)
