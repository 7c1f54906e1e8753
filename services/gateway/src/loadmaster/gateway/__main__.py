"""`python -m loadmaster.gateway --config loadmaster.yaml`"""

from __future__ import annotations

from loadmaster.common.config import Settings
from loadmaster.common.service import run_service
from loadmaster.gateway.server import build


async def _main(settings: Settings) -> None:
    server = await build(settings)
    await server.run()


if __name__ == "__main__":
    run_service("gateway", _main)
