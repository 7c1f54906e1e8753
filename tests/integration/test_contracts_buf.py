"""buf over the proto tree: lint (STANDARD), format and breaking changes against main.

buf comes from the npm package `@bufbuild/buf` that `make node` installs into clients/node.
buf.yaml ignores only the names the KServe protocol fixes; Loadmaster's own contracts follow
the standard rules.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = ROOT / "clients" / "node" / "node_modules" / ".bin" / "buf"

pytestmark = pytest.mark.skipif(not BUF.exists(), reason="buf is not installed (`make node` needs npm)")


def buf(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_lint_is_clean() -> None:
    result = buf("lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_lint_would_catch_a_loadmaster_name_off_the_standard(tmp_path: Path) -> None:
    # The check has teeth: the same config on a copy with one service renamed back fails.
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    scheduler = tmp_path / "protos" / "loadmaster" / "v1" / "scheduler.proto"
    scheduler.write_text(scheduler.read_text().replace("service SchedulerService {", "service Scheduler {"))
    result = buf("lint", cwd=tmp_path)
    assert result.returncode != 0
    assert 'Service name "Scheduler" should be suffixed with "Service"' in result.stdout


def test_format_is_clean() -> None:
    result = buf("format", "--diff", "--exit-code")
    assert result.returncode == 0, result.stdout + result.stderr


def merge_base() -> str:
    for ref in ("main", "origin/main"):
        found = subprocess.run(["git", "merge-base", "HEAD", ref], cwd=ROOT, capture_output=True, text=True)
        if found.returncode == 0:
            return found.stdout.strip()
    return "HEAD"


def test_no_breaking_change_against_the_merge_base_with_main(tmp_path: Path) -> None:
    base = merge_base()
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", base, "buf.yaml"], cwd=ROOT, capture_output=True, text=True
    )
    if "buf.yaml" not in listed.stdout:
        pytest.skip(f"the merge base {base[:12]} predates buf.yaml: nothing to compare against")
    archive = subprocess.run(
        ["git", "archive", base, "buf.yaml", "protos"], cwd=ROOT, capture_output=True, check=True
    )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp_path, filter="data")
    result = buf("breaking", "--against", str(tmp_path))
    assert result.returncode == 0, f"breaking changes against {base[:12]}:\n{result.stdout}{result.stderr}"


def test_breaking_would_catch_a_removed_field(tmp_path: Path) -> None:
    # The check has teeth: a copy of the tree with a field deleted is breaking against today's.
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    edge = tmp_path / "protos" / "loadmaster" / "v1" / "edge.proto"
    text = edge.read_text()
    assert "  string response_id = 2;\n" in text
    edge.write_text(text.replace("  string response_id = 2;\n", ""))
    result = buf("breaking", str(tmp_path), "--against", str(ROOT))
    assert result.returncode != 0
    assert "response_id" in result.stdout


def test_the_internal_scheduler_file_may_drop_a_field_only_with_its_number_reserved(tmp_path: Path) -> None:
    # scheduler.proto is internal (docs/clients.md, "Internal contracts"): a field may go, but
    # its number must stay reserved; the same deletion in a public file is breaking (above).
    def deleted(reserve: bool) -> subprocess.CompletedProcess[str]:
        copy = tmp_path / ("reserved" if reserve else "bare")
        shutil.copytree(ROOT / "protos", copy / "protos")
        shutil.copy(ROOT / "buf.yaml", copy / "buf.yaml")
        scheduler = copy / "protos" / "loadmaster" / "v1" / "scheduler.proto"
        text = scheduler.read_text()
        field = "  repeated LocalQueueDepth local_queue_depth = 7;\n"
        assert field in text
        scheduler.write_text(text.replace(field, "  reserved 7;\n" if reserve else ""))
        return buf("breaking", str(copy), "--against", str(ROOT))

    assert deleted(reserve=True).returncode == 0
    bare = deleted(reserve=False)
    assert bare.returncode != 0
    assert 'field "7" with name "local_queue_depth"' in bare.stdout
