"""`python -m loadmaster.gpu_broker [--config loadmaster.yaml]`"""

from __future__ import annotations

from loadmaster.common.config import Settings
from loadmaster.common.service import run_service
from loadmaster.gpu_broker.server import build


async def _main(settings: Settings) -> None:
    try:
        server = await build(settings)
    except ValueError as error:  # configuration: say what to fix, no traceback
        raise SystemExit(f"gpu-broker: {error}") from None
    await server.run()


if __name__ == "__main__":
    run_service("gpu-broker", _main)
