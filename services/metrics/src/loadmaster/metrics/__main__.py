"""`python -m loadmaster.metrics [--config loadmaster.yaml]`"""

from __future__ import annotations

from loadmaster.common.config import Settings
from loadmaster.common.service import run_service
from loadmaster.metrics.server import build


async def _main(settings: Settings) -> None:
    server = await build(settings)
    await server.run()


def main() -> None:
    run_service("metrics", _main)


if __name__ == "__main__":
    main()
