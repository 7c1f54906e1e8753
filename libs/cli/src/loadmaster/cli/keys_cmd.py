"""`loadmaster keys curve`, `keys api` and `keys internal`: credentials for the gateway and
for processes outside the suite.

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
from typing import Annotated

import typer
import zmq

from loadmaster.cli._config import ConfigOption, settings_from
from loadmaster.common import internal_auth
from loadmaster.common.errors import LoadmasterError

app = typer.Typer(
    help="Make credentials for the gateway (CurveZMQ key pairs, API keys).", no_args_is_help=True
)


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
        wanted = internal_auth.Identity.parse(identity)
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
