"""`make bench`: run every benchmark in bench/ with its defaults, then write bench/RESULTS.md.

    python bench/run_all.py                 # everything
    python bench/run_all.py roundtrip compare_inferential   # a selection

The soak (`make soak`) runs on its own: it takes ten minutes.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SKIP = {"run_all", "report", "soak", "chaos"}  # soak and chaos: their own make targets


def main() -> int:
    wanted = set(sys.argv[1:])
    scripts = [p for p in sorted(BENCH.glob("*.py")) if not p.name.startswith("_") and p.stem not in SKIP]
    if wanted:
        scripts = [p for p in scripts if p.stem in wanted]
    failed = []
    for script in scripts:
        print(f"=== {script.stem} ===", flush=True)
        started = time.monotonic()
        code = subprocess.call([sys.executable, str(script)], cwd=BENCH)
        print(f"=== {script.stem}: exit {code} in {time.monotonic() - started:.0f} s ===\n", flush=True)
        if code != 0:
            failed.append(script.stem)
    subprocess.call([sys.executable, str(BENCH / "report.py")])
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
