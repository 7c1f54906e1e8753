"""Container health probe: ask a gRPC server whether it is SERVING.

    python -m loadmaster.common.healthcheck HOST:PORT [--service NAME] [--timeout S] [--tls-ca FILE]

Exits 0 when the standard health service answers SERVING for `--service`
(default: the whole server), 1 otherwise (NOT_SERVING, unknown service,
unreachable, timed out). Used by the Dockerfiles' HEALTHCHECK and compose.yaml,
so it is synchronous, starts no event loop and reads no configuration file. A server with
TLS (`internal_auth.tls_cert_file`) is checked with `--tls-ca`, which defaults to
$LOADMASTER_INTERNAL_AUTH__TLS_CA_FILE, so a service's own environment is enough.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["check", "main"]


def check(
    address: str, *, service: str = "", timeout_s: float = 2.0, tls_ca: Path | None = None
) -> tuple[bool, str]:
    """`(serving, detail)` for one health Check against `address` (TLS against `tls_ca` if given)."""
    # A probe talks to its own container: never through an HTTP proxy from the environment.
    options = [("grpc.enable_http_proxy", 0)]
    with (
        grpc.insecure_channel(address, options=options)
        if tls_ca is None
        else grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca.read_bytes()), options=options)
    ) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as error:
            code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
            return False, f"health check failed: {code.name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadmaster.common.healthcheck",
        description="Exit 0 when the gRPC server at HOST:PORT reports SERVING, 1 otherwise.",
    )
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("--service", default="", help="service name to check (default: the server)")
    parser.add_argument("--timeout", type=float, default=2.0, metavar="S", help="seconds (default 2)")
    parser.add_argument(
        "--tls-ca",
        type=Path,
        default=os.environ.get("LOADMASTER_INTERNAL_AUTH__TLS_CA_FILE") or None,
        metavar="FILE",
        help="CA of a TLS server (default: $LOADMASTER_INTERNAL_AUTH__TLS_CA_FILE; none: plaintext)",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # usage errors exit 1, not argparse's 2 (reserved by Docker)
        return 0 if exit_.code in (0, None) else 1
    serving, detail = check(args.address, service=args.service, timeout_s=args.timeout, tls_ca=args.tls_ca)
    target = f"{args.address}/{args.service}" if args.service else args.address
    print(f"{target}: {detail}", file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
