"""`python -m loadmaster.model_pool --config loadmaster.yaml`: one model-pool worker."""

from __future__ import annotations

from loadmaster.common.config import Settings
from loadmaster.common.service import run_service
from loadmaster.model_pool.server import build


async def _main(settings: Settings) -> None:
    server = await build(settings)
    await server.run()


def main() -> None:
    run_service("model-pool", _main)


if __name__ == "__main__":
    main()
