"""Fault-injection fixtures: each test gets its own suite, because each one breaks it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loadmaster.cli.launcher import Suite, free_port_overrides

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "examples" / "loadmaster.yaml"


@pytest.fixture()
def make_suite(tmp_path: Path) -> Iterator[Callable[..., Suite]]:
    """Start a private suite on free ports: `make_suite(workers=2, preload=["sleep"], **overrides)`."""
    started: list[Suite] = []

    def make(*, workers: int = 1, preload: list[str] | None = None, **sections: dict[str, Any]) -> Suite:
        overrides = free_port_overrides()
        overrides["model_pool"]["preload"] = preload or ["double"]
        for section, values in sections.items():
            overrides.setdefault(section, {}).update(values)
        suite = Suite(
            CONFIG, overrides=overrides, log_dir=tmp_path / f"suite-{len(started)}", workers=workers
        )
        started.append(suite)
        suite.start(timeout_s=120)
        suite.wait_for_models(overrides["model_pool"]["preload"], timeout_s=120)
        return suite

    yield make
    for suite in started:
        suite.stop()
    for log in sorted(tmp_path.glob("suite-*/*.log")):
        print(
            f"---- {log.parent.name}/{log.name} (tail) ----\n" + "\n".join(log.read_text().splitlines()[-25:])
        )
