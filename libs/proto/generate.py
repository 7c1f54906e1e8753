"""Generate the Python protobuf/gRPC code under libs/proto/src from protos/.

    python libs/proto/generate.py           # regenerate in place (`make protos`)
    python libs/proto/generate.py --check   # exit 1 when the committed code is stale

Protos compile with `-I protos`, so generated imports come out as
`from loadmaster.v1 import tensor_pb2` with no post-editing.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = ROOT / "libs" / "proto" / "src"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """Loadmaster's own contracts. protos/kserve/ is not generated here: the gateway serves
    the KServe messages that `tritonclient[grpc]` ships (loadmaster.gateway.kserve_protocol)."""
    return sorted((PROTO_ROOT / "loadmaster").rglob("*.proto"))


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # a build-time dependency (requirements-dev.txt)

    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generated_files(root: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(root)): p
        for p in root.rglob("*")
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def stale_files() -> list[str]:
    """Generated files that differ from, are missing from, or are extra to a fresh build."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        generate(fresh_root)
        fresh = generated_files(fresh_root)
        committed = generated_files(OUT_ROOT)
        stale = [name for name in fresh if name not in committed]
        stale += [name for name in committed if name not in fresh]
        stale += [
            name
            for name in fresh
            if name in committed and not filecmp.cmp(fresh[name], committed[name], shallow=False)
        ]
        return sorted(stale)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the committed code is stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated code (run `make protos`):", *stale, sep="\n  ")
            return 1
        print("generated code is current")
        return 0
    for path in generated_files(OUT_ROOT).values():
        path.unlink()
    generate(OUT_ROOT)
    print(f"generated {len(generated_files(OUT_ROOT))} files under {OUT_ROOT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
