"""`loadmaster keys add|list|update|revoke` manage the running suite's API keys through the
gateway's admin API (docs/admin.md); `keys curve`, `keys api` and `keys internal` make
credentials offline, for the config file and for processes outside the suite.

`keys add NAME` makes a key, prints it once (the gateway keeps only its SHA-256) and it works
at every gateway within a second; `keys revoke NAME` refuses it from then on; `keys update
NAME --rotate` issues a new key and keeps the old one valid for `--grace-s`. Each has `--json`.

`keys curve` prints a CurveZMQ key pair (Z85). Use one pair as the edge's server keys
(`gateway.auth.curve.server_public_key` / `server_secret_key`) and give clients the
public one; make a pair per client and list their public keys in
`gateway.auth.curve.allowed_client_keys`.

`keys api` makes a random API key, prints it once (give it to the client) and the
`gateway.auth.api_keys` entry, which holds only its SHA-256: the gateway never stores it.

`keys internal --identity trainer/job-7` prints an identity key derived from the suite secret:
its holder can call the suite as that identity and no other (docs/security.md).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
import zmq
from rich.table import Table

from loadmaster.cli._config import ConfigOption, settings_from
from loadmaster.cli._output import print_json, stdout_console
from loadmaster.cli.admin_client import AdminError, ApiKeyOption, GatewayOption, admin_client, fail
from loadmaster.common import internal_auth
from loadmaster.common.credentials import Identity
from loadmaster.common.errors import LoadmasterError

app = typer.Typer(
    help="API keys of the running suite (add, list, update, revoke), and credentials made offline "
    "(CurveZMQ key pairs, API key entries, identity keys).",
    no_args_is_help=True,
)

ScopeOption = Annotated[
    list[str] | None, typer.Option("--scope", help="infer and/or admin (repeatable; default infer)")
]
JsonOption = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]


def _scopes(scope: list[str] | None) -> list[str] | None:
    bad = [s for s in scope or [] if s not in ("infer", "admin")]
    if bad:
        raise typer.BadParameter(f"unknown scope {bad[0]!r} (infer, admin)", param_hint="--scope")
    return scope or None


def _when(unix_s: float | None) -> str:
    if unix_s is None:
        return "never"
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="seconds")


def _call(
    config: Any, gateway: str | None, api_key: str | None, method: str, path: str, body: Any = None
) -> Any:
    with admin_client(config, gateway, api_key) as client:
        try:
            return client.call(method, path, body=body)
        except AdminError as error:
            raise fail(error) from None


def _say_key(view: dict[str, Any], as_json: bool, verb: str) -> None:
    if as_json:
        print_json(view)
        return
    out = stdout_console()
    if view.get("key"):
        out.print(f"API key '{view['name']}' (shown once; the gateway keeps only its hash):")
        out.print(view["key"], soft_wrap=True, highlight=False)
    scopes = ", ".join(view["scopes"])
    out.print(
        f"{verb} '{view['name']}': {view['state']}, scopes {scopes}, "
        f"rate {view['rate_per_s']:g}/s, tenant {view['tenant'] or view['name']}, expires {_when(view['expires_unix_s'])}"
    )
    for grace in view.get("grace", []):
        out.print(
            f"the previous key ({grace['sha256_prefix']}…) stays valid until {_when(grace['until_unix_s'])}"
        )


@app.command()
def add(
    name: Annotated[str, typer.Argument(help="the key's name (shown in logs, audit and errors)")],
    scope: ScopeOption = None,
    rate_per_s: Annotated[float, typer.Option(min=0, help="requests per second; 0 = unlimited")] = 0.0,
    burst: Annotated[int, typer.Option(min=0, help="token-bucket size; 0 = max(1, rate)")] = 0,
    tenant: Annotated[str, typer.Option(help="the tenant it serves (default: its name)")] = "",
    weight: Annotated[
        float | None, typer.Option(help="the tenant's weight for token fairness (tenants.T.weight)")
    ] = None,
    expires_in_s: Annotated[
        float | None, typer.Option(help="refuse the key this many seconds from now")
    ] = None,
    config: ConfigOption = None,
    gateway: GatewayOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """Add an API key to the running suite; it is printed once (`--json`: {"name", "key", ...})."""
    body: dict[str, Any] = {"name": name, "scopes": _scopes(scope) or ["infer"], "rate_per_s": rate_per_s}
    body |= {"burst": burst, "tenant": tenant}
    if weight is not None:
        body["weight"] = weight
    if expires_in_s is not None:
        body["expires_in_s"] = expires_in_s
    _say_key(_call(config, gateway, api_key, "POST", "/admin/v1/keys", body), as_json, "added")


@app.command("list")
def list_keys(
    config: ConfigOption = None,
    gateway: GatewayOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """Every key (the configured ones, those added at run time, revoked ones), never the key itself."""
    keys = _call(config, gateway, api_key, "GET", "/admin/v1/keys")["keys"]
    if as_json:
        print_json({"keys": keys})
        return
    table = Table(title="API keys")
    for column in (
        "name",
        "state",
        "scopes",
        "rate/s",
        "tenant",
        "expires",
        "sha256",
        "grace until",
        "source",
    ):
        table.add_column(column)
    for k in keys:
        table.add_row(
            k["name"],
            k["state"],
            ", ".join(k["scopes"]),
            f"{k['rate_per_s']:g}" if k["rate_per_s"] else "-",
            k["tenant"] or k["name"],
            _when(k["expires_unix_s"]),
            k["sha256_prefix"],
            ", ".join(_when(g["until_unix_s"]) for g in k["grace"]) or "-",
            k["source"],
        )
    stdout_console().print(table)


@app.command()
def update(
    name: str,
    scope: ScopeOption = None,
    rate_per_s: Annotated[
        float | None, typer.Option(min=0, help="requests per second; 0 = unlimited")
    ] = None,
    burst: Annotated[int | None, typer.Option(min=0, help="token-bucket size; 0 = max(1, rate)")] = None,
    tenant: Annotated[str | None, typer.Option(help="the tenant it serves")] = None,
    weight: Annotated[float | None, typer.Option(help="the tenant's weight (tenants.T.weight)")] = None,
    expires_in_s: Annotated[
        float | None, typer.Option(help="refuse the key this many seconds from now")
    ] = None,
    no_expiry: Annotated[bool, typer.Option("--no-expiry", help="the key never expires")] = False,
    rotate: Annotated[bool, typer.Option("--rotate", help="issue a new key (printed once)")] = False,
    grace_s: Annotated[
        float, typer.Option(min=0, help="with --rotate: how long the old key stays valid")
    ] = 3600.0,
    config: ConfigOption = None,
    gateway: GatewayOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """Change a key's scopes, rate limit, tenant or expiry; `--rotate` issues a new key."""
    if expires_in_s is not None and no_expiry:
        raise typer.BadParameter("give --expires-in-s or --no-expiry, not both", param_hint="--no-expiry")
    body: dict[str, Any] = {}
    if (scopes := _scopes(scope)) is not None:
        body["scopes"] = scopes
    for field, value in (
        ("rate_per_s", rate_per_s),
        ("burst", burst),
        ("tenant", tenant),
        ("weight", weight),
    ):
        if value is not None:
            body[field] = value
    if expires_in_s is not None:
        body["expires_in_s"] = expires_in_s
    if no_expiry:
        body["expires_unix_s"] = None
    if rotate:
        body |= {"rotate": True, "grace_s": grace_s}
    if not body:
        raise typer.BadParameter("nothing to change (see --help)")
    _say_key(_call(config, gateway, api_key, "PATCH", f"/admin/v1/keys/{name}", body), as_json, "updated")


@app.command()
def revoke(
    name: str,
    config: ConfigOption = None,
    gateway: GatewayOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """Refuse the key (and a rotated-out one of its name) at every gateway from now on."""
    _say_key(_call(config, gateway, api_key, "DELETE", f"/admin/v1/keys/{name}"), as_json, "revoked")


@app.command()
def curve(
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of YAML")] = False,
) -> None:
    """A CurveZMQ key pair (Z85 text): the secret stays with its owner, the public key is shared."""
    public, secret = zmq.curve_keypair()
    pair = {"public_key": public.decode(), "secret_key": secret.decode()}
    if as_json:
        typer.echo(json.dumps(pair))
        return
    # Z85 uses YAML-special characters (and never `"` or `\\`): always double-quoted.
    typer.echo(f'public_key: "{pair["public_key"]}"\nsecret_key: "{pair["secret_key"]}"')


@app.command()
def api(
    name: Annotated[str, typer.Option(help="a name for the key (shown in errors and logs)")],
    scope: Annotated[
        list[str] | None, typer.Option("--scope", help="infer and/or admin (repeatable; default infer)")
    ] = None,
    rate_per_s: Annotated[float, typer.Option(min=0, help="requests per second; 0 = unlimited")] = 0.0,
    burst: Annotated[int, typer.Option(min=0, help="token-bucket size; 0 = max(1, rate)")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of YAML")] = False,
) -> None:
    """A random API key and its hashed `gateway.auth.api_keys` entry."""
    scopes = scope or ["infer"]
    bad = [s for s in scopes if s not in ("infer", "admin")]
    if bad:
        raise typer.BadParameter(f"unknown scope {bad[0]!r} (infer, admin)", param_hint="--scope")
    key = "lm_" + secrets.token_urlsafe(32)
    entry = {
        "name": name,
        "sha256": hashlib.sha256(key.encode()).hexdigest(),
        "scopes": scopes,
        "rate_per_s": rate_per_s,
        "burst": burst,
    }
    if as_json:
        typer.echo(json.dumps({"key": key, "entry": entry}))
        return
    typer.echo(f"# API key (shown once; the gateway keeps only its hash): {key}")
    typer.echo("gateway:\n  auth:\n    api_keys:")
    typer.echo(
        f"      - {{name: {name}, sha256: {entry['sha256']}, scopes: [{', '.join(scopes)}], "
        f"rate_per_s: {rate_per_s:g}, burst: {burst}}}"
    )


@app.command()
def internal(
    identity: Annotated[
        str, typer.Option(help="who the key speaks for: <service>/<instance>, e.g. trainer/job-7")
    ],
    config: ConfigOption = None,
) -> None:
    """An identity key for a process outside the suite (a training job taking GPU leases): it
    can sign only as IDENTITY, so it cannot act for the services or release others' leases.
    Give it to the process as its `internal_auth.secret_file` (docs/security.md)."""
    settings = settings_from(config)
    try:
        wanted = Identity.parse(identity)
    except LoadmasterError as error:
        raise typer.BadParameter(error.message, param_hint="--identity") from None
    suite = internal_auth.client_credentials(settings, wanted)
    if suite is None or not suite.can_verify:
        raise typer.BadParameter(
            "the config names no suite secret (internal_auth.secret_file)", param_hint="--config"
        )
    try:
        typer.echo(suite.identity_key(wanted))
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--identity") from None
