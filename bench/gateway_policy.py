"""What the gateway's policy costs a request, in the process (no sockets): verifying an OIDC
token (first time, and remembered), checking a stream chunk and a prompt against a blocklist,
and handing an audit record to its writer thread. Writes bench/results/gateway_policy.json.

    python bench/gateway_policy.py
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import jwt
from _harness import write_result
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt import PyJWK
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from loadmaster.common.gateway_config import AuditSettings, OidcSettings
from loadmaster.gateway.audit import AuditLog, AuditRecord
from loadmaster.gateway.guardrails import Blocklist, StreamScreen
from loadmaster.gateway.oidc import JwksKeys, OidcVerifier

WORDS = ["forbidden", "top secret", "confidential", *(f"word{i}" for i in range(100))]
PATTERNS = [r"\bkey-\d{4}\b", r"(?i)ssn:\s*\d{3}-\d{2}-\d{4}"]


def per_call_us(run: Any, count: int) -> float:
    started = time.perf_counter()
    for index in range(count):
        run(index)
    return round((time.perf_counter() - started) / count * 1e6, 2)


async def tokens() -> dict[str, float]:
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    jwks = [
        PyJWK.from_dict({**json.loads(RSAAlgorithm.to_jwk(rsa_key.public_key())), "kid": "RS256"}),
        PyJWK.from_dict({**json.loads(ECAlgorithm.to_jwk(ec_key.public_key())), "kid": "ES256"}),
    ]
    settings = OidcSettings(issuer="https://issuer", audience=["loadmaster"])
    verifier = OidcVerifier(settings, keys=JwksKeys(lambda: jwks, cache_s=300, refetch_interval_s=30))
    out: dict[str, float] = {}
    for alg, key in (("RS256", rsa_key), ("ES256", ec_key)):
        count = 500
        made = [
            jwt.encode(
                {
                    "iss": "https://issuer",
                    "aud": "loadmaster",
                    "sub": f"user-{i}",
                    "exp": int(time.time()) + 3600,
                },
                key,
                algorithm=alg,
                headers={"kid": alg},
            )
            for i in range(count)
        ]
        await verifier.verify(made[0])  # the key set is fetched
        started = time.perf_counter()
        for token in made[1:]:
            await verifier.verify(token)
        out[f"verify_{alg}_first_us"] = round((time.perf_counter() - started) / (count - 1) * 1e6, 2)
        started = time.perf_counter()
        for token in made[1:]:
            await verifier.verify(token)
        out[f"verify_{alg}_remembered_us"] = round((time.perf_counter() - started) / (count - 1) * 1e6, 2)
    return out


def guardrails() -> dict[str, float]:
    blocklist = Blocklist(WORDS, PATTERNS)
    pieces = [f"tok{i % 10} " for i in range(1000)]

    def stream(_: int) -> None:
        screen = StreamScreen(blocklist, holdback=64)
        for piece in pieces:
            screen.feed(piece)
        screen.finish()

    prompt_2k = ("lorem ipsum dolor sit amet " * 80)[:2048]
    prompt_64k = "lorem ipsum dolor sit amet " * 2428
    return {
        "stream_chunk_us": round(per_call_us(stream, 20) / len(pieces), 2),
        "prompt_2KiB_scan_us": per_call_us(lambda _: blocklist.find(prompt_2k), 200),
        "prompt_64KiB_scan_us": per_call_us(lambda _: blocklist.find(prompt_64k), 20),
    }


def audit() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        log = AuditLog(AuditSettings(enabled=True), path=Path(folder) / "audit.jsonl")
        log.start()
        record = AuditRecord(
            time_unix_s=time.time(),
            request_id="r",
            endpoint="chat.completions",
            outcome="ok",
            status=200,
            latency_ms=1.0,
            prompt="p" * 4000,
            completion="c" * 1000,
        )
        cost = per_call_us(lambda _: log.write(record), 5000)
        log.close()
        return {"audit_write_us": cost, "audit_dropped": log.dropped}


def main() -> None:
    result = {**asyncio.run(tokens()), **guardrails(), **audit()}
    for name, value in result.items():
        print(f"{name:28} {value}")
    print("wrote", write_result("gateway_policy", result))


if __name__ == "__main__":
    main()
