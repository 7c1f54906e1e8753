"""Render haproxy.cfg from haproxy.cfg.template for a list of gateways (docs/deploy.md).

    python deploy/haproxy/render.py --edge-bind 0.0.0.0:5555 --grpc-bind 0.0.0.0:8001 \
        --http-bind 0.0.0.0:8000 --gateway 10.0.0.11:5555:8001:8000 --gateway 10.0.0.12:5555:8001:8000 \
        > /etc/haproxy/haproxy.cfg

Each `--gateway` is HOST:EDGE_PORT:GRPC_PORT:HTTP_PORT (the gateway's `edge.bind`, `address`
and `http_port`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from string import Template

TEMPLATE = Path(__file__).with_name("haproxy.cfg.template")


@dataclass(frozen=True, slots=True)
class Gateway:
    host: str
    edge_port: int
    grpc_port: int
    http_port: int

    @classmethod
    def parse(cls, text: str) -> Gateway:
        host, edge, grpc, http = text.rsplit(":", 3)
        return cls(host, int(edge), int(grpc), int(http))


def render(
    gateways: list[Gateway], *, edge_bind: str, grpc_bind: str, http_bind: str, stats_socket: str = ""
) -> str:
    """The config; `stats_socket` adds HAProxy's runtime API (`show stat`: sessions per server)."""
    if not gateways:
        raise ValueError("at least one gateway is needed")

    def servers(port_of: str) -> str:
        return "\n".join(
            f"    server gw{i} {g.host}:{getattr(g, port_of)} check" for i, g in enumerate(gateways, 1)
        )

    text = Template(TEMPLATE.read_text()).substitute(
        EDGE_BIND=edge_bind,
        GRPC_BIND=grpc_bind,
        HTTP_BIND=http_bind,
        EDGE_SERVERS=servers("edge_port"),
        GRPC_SERVERS=servers("grpc_port"),
        HTTP_SERVERS=servers("http_port"),
    )
    if stats_socket:
        text = text.replace("global\n", f"global\n    stats socket {stats_socket} mode 600 level admin\n", 1)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--edge-bind", default="0.0.0.0:5555")
    parser.add_argument("--grpc-bind", default="0.0.0.0:8001")
    parser.add_argument("--http-bind", default="0.0.0.0:8000")
    parser.add_argument("--gateway", action="append", required=True, type=Gateway.parse)
    parser.add_argument("--stats-socket", default="")
    args = parser.parse_args()
    print(
        render(
            args.gateway,
            edge_bind=args.edge_bind,
            grpc_bind=args.grpc_bind,
            http_bind=args.http_bind,
            stats_socket=args.stats_socket,
        )
    )


if __name__ == "__main__":
    main()
