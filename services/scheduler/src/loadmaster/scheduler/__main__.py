"""`python -m loadmaster.scheduler [--config loadmaster.yaml]`"""

from __future__ import annotations

from loadmaster.common.config import Settings
from loadmaster.common.service import run_service
from loadmaster.scheduler.server import build


async def _main(settings: Settings) -> None:
    await build(settings).run()


if __name__ == "__main__":
    run_service("scheduler", _main)
