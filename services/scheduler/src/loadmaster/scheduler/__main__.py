"""`python -m loadmaster.scheduler [--config loadmaster.yaml]`"""

from __future__ import annotations

import logging
import sys

from loadmaster.common.config import Settings
from loadmaster.common.errors import LoadmasterError
from loadmaster.common.service import run_service
from loadmaster.scheduler.leadership import serve_as_leader
from loadmaster.scheduler.server import build


async def _main(settings: Settings) -> None:
    if not settings.scheduler.leader_lease.enabled:
        await build(settings).run()
        return
    try:
        await serve_as_leader(settings, build)  # a standby waits here until it leads
    except LoadmasterError as error:
        logging.getLogger("scheduler").error("%s", error.message)
        sys.exit(1)  # not leading: the supervisor restarts this scheduler as a standby


if __name__ == "__main__":
    run_service("scheduler", _main)
