"""Render haproxy.cfg from haproxy.cfg.template for a list of gateways (docs/deploy.md).

    python deploy/haproxy/render.py --edge-bind 0.0.0.0:5555 --grpc-bind 0.0.0.0:8001 \
        --http-bind 0.0.0.0:8000 --gateway 10.0.0.11:5555:8001:8000 --gateway 10.0.0.12:5555:8001:8000 \
        > /etc/haproxy/haproxy.cfg

Each `--gateway` is HOST:EDGE_PORT:GRPC_PORT:HTTP_PORT[:GR00T_PORT] (the gateway's `edge.bind`,
`address`, `http_port` and `gr00t.bind`); with `--gr00t-bind`, GR00T clients are balanced too.
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
    gr00t_port: int = 0  # 0: no GR00T front end

    @classmethod
    def parse(cls, text: str) -> Gateway:
        if text.startswith("["):  # [IPv6]:...
            host, _, rest = text.partition("]:")
            host += "]"
        else:
            host, _, rest = text.partition(":")
        ports = [int(port) for port in rest.split(":")]
        if len(ports) not in (3, 4):
            raise ValueError(f"--gateway is HOST:EDGE:GRPC:HTTP[:GR00T], not {text!r}")
        return cls(host, *ports)


def render(
    gateways: list[Gateway],
    *,
    edge_bind: str,
    grpc_bind: str,
    http_bind: str,
    stats_socket: str = "",
    gr00t_bind: str = "",
) -> str:
    """The config; `stats_socket` adds HAProxy's runtime API (`show stat`: sessions per server)."""
    if not gateways:
        raise ValueError("at least one gateway is needed")

    def servers(port_of: str) -> str:
        return "\n".join(
            f"    server gw{i} {g.host}:{getattr(g, port_of)} check" for i, g in enumerate(gateways, 1)
        )

    gr00t = ""
    if gr00t_bind:
        if not all(g.gr00t_port for g in gateways):
            raise ValueError("--gr00t-bind needs every --gateway's GR00T port (HOST:EDGE:GRPC:HTTP:GR00T)")
        gr00t = (
            f"frontend gr00t\n    mode tcp\n    bind {gr00t_bind}\n    default_backend gateways_gr00t\n\n"
            f"backend gateways_gr00t\n    mode tcp\n    balance leastconn\n{servers('gr00t_port')}\n\n"
        )
    text = Template(TEMPLATE.read_text()).substitute(
        GR00T_SECTION=gr00t,
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
    parser.add_argument("--gr00t-bind", default="", help="e.g. 0.0.0.0:5557 (GR00T clients, TCP mode)")
    parser.add_argument("--stats-socket", default="")
    args = parser.parse_args()
    print(
        render(
            args.gateway,
            edge_bind=args.edge_bind,
            grpc_bind=args.grpc_bind,
            http_bind=args.http_bind,
            stats_socket=args.stats_socket,
            gr00t_bind=args.gr00t_bind,
        )
    )


if __name__ == "__main__":
    main()
