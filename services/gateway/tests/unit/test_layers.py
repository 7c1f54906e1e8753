"""The gateway's layers: front ends translate into the core's request plane and import only
downward; nothing in the core imports a front end, except the module that assembles the app
(docs/design/gateway.md)."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "src" / "loadmaster" / "gateway"
ASSEMBLY = {"server.py", "__main__.py"}  # where the app is put together


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def test_no_core_module_imports_a_front_end() -> None:
    offenders = {
        path.name: sorted(m for m in _imports(path) if m.startswith("loadmaster.gateway.frontends"))
        for path in GATEWAY.glob("*.py")
        if path.name not in ASSEMBLY
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_front_ends_share_no_private_helpers() -> None:
    """A helper two front ends need is public in a shared module, not imported as `_name`."""
    private = {}
    for path in (GATEWAY / "frontends").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loadmaster.gateway"):
                names = [alias.name for alias in node.names if alias.name.startswith("_")]
                if names:
                    private[path.name] = names
    assert private == {}
