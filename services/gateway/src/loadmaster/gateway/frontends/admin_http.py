"""The admin API over HTTP (`/admin/v1/...`, admin scope): translation only (docs/admin.md).

    GET    /admin/v1/keys                     every key (never the key itself; its hash cut short)
    POST   /admin/v1/keys                     {"name", "scopes", "rate_per_s", "burst", "tenant",
                                              "expires_unix_s" | "expires_in_s", "weight"} -> the key, once
    PATCH  /admin/v1/keys/{name}              the fields to change; {"rotate": true, "grace_s": N}
    DELETE /admin/v1/keys/{name}              revoke
    GET    /admin/v1/guardrails               the rules in force, with their ids
    POST   /admin/v1/guardrails               {"kind": "word" | "pattern", "value"}
    DELETE /admin/v1/guardrails/{id}
    GET    /admin/v1/config[?key=PATH]        runtime settings in force, and which are stored
    PUT    /admin/v1/config                   {"key", "value"} | {"values": {...}} | {"key", "reset": true}
    GET    /admin/v1/queues                   the scheduler's queues (alias: /admin/queues)
    POST   /admin/v1/strategy                 {"strategy", "policy"}: switch and store (alias: /admin/strategy)

Every call needs the `admin` scope (an API key, an OIDC token, or the suite's admin credential
as the bearer token), unless keys are not required (open mode). A refused call is audited too.
Errors are `{"error": message}` with the status of their `LoadmasterError`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loadmaster.common.errors import InternalError, InvalidArgumentError, LoadmasterError
from loadmaster.gateway.admin import SchedulerAdmin
from loadmaster.gateway.admin_plane import AdminPlane
from loadmaster.gateway.auth import ADMIN, Authenticator, Principal, bearer_token

__all__ = ["MAX_ADMIN_BODY_BYTES", "admin_routes"]

log = logging.getLogger(__name__)

MAX_ADMIN_BODY_BYTES = 1 << 20
KEY_FIELDS = ("scopes", "rate_per_s", "burst", "tenant", "expires_unix_s")

Handler = Callable[[Request, Principal], Awaitable[Any]]


async def _body(request: Request) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_ADMIN_BODY_BYTES:
        raise InvalidArgumentError(f"request body exceeds the limit of {MAX_ADMIN_BODY_BYTES} bytes")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_ADMIN_BODY_BYTES:
            raise InvalidArgumentError(f"request body exceeds the limit of {MAX_ADMIN_BODY_BYTES} bytes")
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidArgumentError("request body is not JSON") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError("request body must be a JSON object")
    return value


def _only(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise InvalidArgumentError(f"{unknown[0]}: not a field of this call (fields: {', '.join(allowed)})")


def _typed(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise InvalidArgumentError(f"{name}: wrong type ({type(value).__name__})")
    if not isinstance(value, kinds):
        raise InvalidArgumentError(f"{name}: wrong type ({type(value).__name__})")
    return value


def _expiry(body: dict[str, Any]) -> float | None:
    at = _typed(body, "expires_unix_s", (int, float))
    within = _typed(body, "expires_in_s", (int, float))
    if at is not None and within is not None:
        raise InvalidArgumentError("expires_unix_s, expires_in_s: give one of them")
    if within is not None:
        if within <= 0:
            raise InvalidArgumentError("expires_in_s: must be greater than 0")
        return time.time() + float(within)
    return None if at is None else float(at)


def admin_routes(plane: AdminPlane, scheduler: SchedulerAdmin, auth: Authenticator) -> list[Route]:
    async def list_keys(request: Request, who: Principal) -> Any:
        return {"keys": plane.list_keys()}

    async def add_key(request: Request, who: Principal) -> Any:
        body = await _body(request)
        _only(body, ("name", *KEY_FIELDS, "expires_in_s", "weight"))
        name = _typed(body, "name", str, "")
        if not name:
            raise InvalidArgumentError("name: required")
        return await plane.add_key(
            who,
            name,
            scopes=_typed(body, "scopes", list, ["infer"]),
            rate_per_s=_typed(body, "rate_per_s", (int, float), 0.0),
            burst=_typed(body, "burst", int, 0),
            tenant=_typed(body, "tenant", str, ""),
            expires_unix_s=_expiry(body),
            weight=_typed(body, "weight", (int, float)),
        )

    async def update_key(request: Request, who: Principal) -> Any:
        body = await _body(request)
        _only(body, (*KEY_FIELDS, "expires_in_s", "rotate", "grace_s", "weight"))
        changes = {name: body[name] for name in KEY_FIELDS if name in body and name != "expires_unix_s"}
        if "expires_unix_s" in body or "expires_in_s" in body:
            changes["expires_unix_s"] = _expiry(body)  # null: never expires
        return await plane.update_key(
            who,
            request.path_params["name"],
            changes,
            rotate=_typed(body, "rotate", bool, False),
            grace_s=float(_typed(body, "grace_s", (int, float), 3600.0)),
            weight=_typed(body, "weight", (int, float)),
        )

    async def revoke_key(request: Request, who: Principal) -> Any:
        return await plane.revoke_key(who, request.path_params["name"])

    async def list_guardrails(request: Request, who: Principal) -> Any:
        return {"guardrails": plane.list_guardrails()}

    async def add_guardrail(request: Request, who: Principal) -> Any:
        body = await _body(request)
        _only(body, ("kind", "value"))
        return await plane.add_guardrail(who, _typed(body, "kind", str, ""), _typed(body, "value", str, ""))

    async def remove_guardrail(request: Request, who: Principal) -> Any:
        return await plane.remove_guardrail(who, request.path_params["id"])

    async def get_config(request: Request, who: Principal) -> Any:
        return plane.get_config(request.query_params.get("key") or None)

    async def put_config(request: Request, who: Principal) -> Any:
        body = await _body(request)
        _only(body, ("key", "value", "values", "reset"))
        if "values" in body:
            values = _typed(body, "values", dict, {})
            if "key" in body or "value" in body or "reset" in body:
                raise InvalidArgumentError("values: give either values, or key with value or reset")
            return await plane.set_config(who, values)
        key = _typed(body, "key", str, "")
        if not key:
            raise InvalidArgumentError(
                'key: required ({"key": "scheduler.strategy", "value": "round_robin"})'
            )
        if _typed(body, "reset", bool, False):
            if "value" in body:
                raise InvalidArgumentError("value: not with reset")
            return await plane.reset_config(who, [key])
        if "value" not in body:
            raise InvalidArgumentError("value: required (JSON; null removes a mapping entry)")
        return await plane.set_config(who, {key: body["value"]})

    async def queues(request: Request, who: Principal) -> Any:
        return await scheduler.queues()

    async def strategy(request: Request, who: Principal) -> Any:
        body = await _body(request)
        name, policy = body.get("strategy"), body.get("policy", "")
        if not isinstance(name, str) or not name or not isinstance(policy, (str, type(None))):
            raise InvalidArgumentError('body must be {"strategy": <name>, "policy": <name, optional>}')
        reply = await plane.set_config(who, {"scheduler.strategy": name, "scheduler.policy": policy or None})
        return {**reply.get("scheduler", {}), "persisted": reply["persisted"]}

    def route(path: str, handler: Handler, method: str, action: str, *, status: int = 200) -> Route:
        async def endpoint(request: Request) -> Response:
            who = Principal("", "none")
            try:
                token = bearer_token(request.headers.get("authorization"))
                try:
                    who = await auth.authenticate(token, ADMIN)
                except LoadmasterError as error:
                    if method != "GET":  # who tried to change what: audited
                        plane.refused(auth.identify(token), action, _target(request), error)
                    raise
                return JSONResponse(await handler(request, who), status_code=status)
            except Exception as error:
                mapped = error if isinstance(error, LoadmasterError) else None
                if mapped is None:
                    log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=error)
                    mapped = InternalError(f"internal error: {type(error).__name__}")
                return JSONResponse({"error": mapped.message}, status_code=mapped.http_status)

        return Route(path, endpoint, methods=[method])

    v1 = "/admin/v1"
    return [
        route(f"{v1}/keys", list_keys, "GET", "keys.list"),
        route(f"{v1}/keys", add_key, "POST", "keys.add", status=201),
        route(f"{v1}/keys/{{name}}", update_key, "PATCH", "keys.update"),
        route(f"{v1}/keys/{{name}}", revoke_key, "DELETE", "keys.revoke"),
        route(f"{v1}/guardrails", list_guardrails, "GET", "guardrails.list"),
        route(f"{v1}/guardrails", add_guardrail, "POST", "guardrails.add", status=201),
        route(f"{v1}/guardrails/{{id}}", remove_guardrail, "DELETE", "guardrails.remove"),
        route(f"{v1}/config", get_config, "GET", "config.get"),
        route(f"{v1}/config", put_config, "PUT", "config.set"),
        route(f"{v1}/queues", queues, "GET", "queues"),
        route(f"{v1}/strategy", strategy, "POST", "config.set"),
        route("/admin/queues", queues, "GET", "queues"),  # the paths before /admin/v1
        route("/admin/strategy", strategy, "POST", "config.set"),
    ]


def _target(request: Request) -> str:
    params = request.path_params
    return str(params.get("name") or params.get("id") or request.url.path)
