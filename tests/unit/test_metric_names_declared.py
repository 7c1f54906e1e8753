"""Every series a service records by a literal name is declared in `METRICS`: an undeclared one
is kept for `loadmaster top` but never reaches Prometheus (the metrics service logs it once),
which is how ten series of the generative scheduling and the edge went unexposed."""

from __future__ import annotations

import re
from pathlib import Path

from loadmaster.common.metric_names import METRICS

ROOT = Path(__file__).resolve().parents[2]
# record("name", ...), self._record("name", ...), _record_labels("name", ...)
_RECORDED = re.compile(r"""\b_?record(?:_labels)?\(\s*["']([a-z][a-z0-9_]*)["']""")
# names recorded in a loop over a literal tuple (generation_port's scheduling counters)
_NAMES = re.compile(r"""\bnames = \(([^)]*)\)""")


def _recorded() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in [*ROOT.glob("services/*/src/**/*.py"), *ROOT.glob("libs/*/src/**/*.py")]:
        text = path.read_text()
        names = _RECORDED.findall(text)
        for group in _NAMES.findall(text):
            names += re.findall(r"""["']([a-z][a-z0-9_]*)["']""", group)
        for name in names:
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_recorded_series_is_declared() -> None:
    recorded = _recorded()
    assert "time_to_first_token_ms" in recorded and "kv_recomputed" in recorded  # the scan sees them
    undeclared = {name: where for name, where in recorded.items() if name not in METRICS}
    assert undeclared == {}
