"""The worker imports the engines of the models it preloads before it serves (a fresh
interpreter, so that no other test has imported them already)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[4] / "examples" / "models"

_PROGRAM = """
import json, sys
from loadmaster.model_pool.repository import ModelRepository
from loadmaster.model_pool.server import import_engines
module = "loadmaster.model_pool.engines.torch"
before = module in sys.modules
imported = import_engines(ModelRepository(sys.argv[1]), ["double", "policy", "not-a-model"])
print(json.dumps({"before": before, "after": module in sys.modules, "imported": imported}))
"""


def test_the_preloaded_models_engines_are_imported_up_front() -> None:
    pytest.importorskip("torch")
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, str(MODELS)], capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(done.stdout)
    assert result == {"before": False, "after": True, "imported": ["python", "torch"]}
