"""The ordering strategies, kept at their old import path: they live in
`loadmaster.common.ordering`, shared with the gateways' local queues (docs/data-path.md).
Policy modules written against `loadmaster.scheduler.strategies` keep working."""

from loadmaster.common.ordering import *  # noqa: F403
from loadmaster.common.ordering import __all__  # noqa: F401
