"""Debian's protoc generates C++, Java, C# and Python from the whole proto tree, warning-free.

`make protoc` installs Debian's protobuf-compiler where it is missing. Each module root is
compiled on its own include path: protos/ for Loadmaster's contracts (imports read
`loadmaster/v1/...`), protos/kserve/ for the KServe protocol.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOC = shutil.which("protoc")

pytestmark = pytest.mark.skipif(PROTOC is None, reason="Debian's protoc is not installed (`make protoc`)")

MODULES = {
    ROOT / "protos": sorted(
        p.relative_to(ROOT / "protos") for p in (ROOT / "protos" / "loadmaster").rglob("*.proto")
    ),
    ROOT / "protos" / "kserve": [Path("inference/grpc_service.proto")],
}
LANGUAGES = {"cpp": ".pb.cc", "java": ".java", "csharp": ".cs", "python": "_pb2.py"}


@pytest.mark.parametrize("language", sorted(LANGUAGES))
def test_protoc_generates_every_file_without_a_warning(language: str, tmp_path: Path) -> None:
    assert PROTOC is not None
    out = tmp_path / language
    out.mkdir()
    for include, files in MODULES.items():
        args = [PROTOC, f"-I{include}", f"--{language}_out={out}", *map(str, files)]
        result = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stderr == "" and result.stdout == "", result.stderr  # not even a warning
    generated = [p for p in out.rglob("*") if p.name.endswith(LANGUAGES[language])]
    assert len(generated) >= sum(len(files) for files in MODULES.values())


def test_java_gets_one_class_per_message_in_the_loadmaster_package(tmp_path: Path) -> None:
    # java_multiple_files and java_package: no outer-class renames (Scheduler -> SchedulerOuterClass).
    assert PROTOC is not None
    files = MODULES[ROOT / "protos"]
    subprocess.run(
        [PROTOC, f"-I{ROOT / 'protos'}", f"--java_out={tmp_path}", *map(str, files)], check=True, timeout=120
    )
    package = tmp_path / "dev" / "loadmaster" / "v1"
    assert (package / "Observation.java").exists() and (package / "SchedulerProto.java").exists()
    assert not list(tmp_path.rglob("*OuterClass.java"))
