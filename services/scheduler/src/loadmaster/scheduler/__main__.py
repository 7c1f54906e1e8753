"""`python -m loadmaster.scheduler [--config loadmaster.yaml]`"""

from __future__ import annotations

import logging
import sys

from loadmaster.common.admin_store import stored_settings
from loadmaster.common.config import Settings
from loadmaster.common.errors import LoadmasterError
from loadmaster.common.ordering import load_policy_modules
from loadmaster.common.service import run_service
from loadmaster.scheduler.config import strategy_factory
from loadmaster.scheduler.leadership import serve_as_leader
from loadmaster.scheduler.server import build

log = logging.getLogger("scheduler")


async def _with_stored_strategy(settings: Settings) -> Settings:
    """The strategy (and policy) set at run time (`loadmaster scheduler use`, docs/admin.md),
    unless it cannot be made here (then the file's, with an error naming it)."""
    merged = await stored_settings(settings, warn=("scheduler.",))
    chosen, configured = merged.scheduler, settings.scheduler
    if (chosen.strategy, chosen.policy) == (configured.strategy, configured.policy):
        return settings
    load_policy_modules(configured.policy_modules)
    try:
        strategy_factory(merged)(chosen.strategy, chosen.policy)
    except ValueError as error:
        log.error("the strategy set at run time cannot be used (%s); using the file's", error)
        return settings
    scheduler = configured.model_copy(update={"strategy": chosen.strategy, "policy": chosen.policy})
    return settings.model_copy(update={"scheduler": scheduler})


async def _main(settings: Settings) -> None:
    settings = await _with_stored_strategy(settings)
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
