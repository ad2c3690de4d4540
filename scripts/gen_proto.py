"""Generate libs/apogee-proto from proto/: Python messages, gRPC stubs and their type stubs.

    uv run python scripts/gen_proto.py           # regenerate
    uv run python scripts/gen_proto.py --check   # fail if the committed stubs are stale

The generated files are committed (services install them without protoc) and never edited.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
OUT = ROOT / "libs" / "apogee-proto" / "src"
GENERATED = OUT / "apogee" / "v1"


def generate(into: Path) -> None:
    files = sorted(str(p.relative_to(PROTO)) for p in PROTO.rglob("*.proto"))
    bindir = Path(sys.executable).parent
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO}",
        f"--python_out={into}",
        f"--grpc_python_out={into}",
        f"--mypy_out={into}",
        f"--mypy_grpc_out={into}",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        *files,
    ]
    subprocess.run(cmd, check=True, cwd=PROTO)
    (into / "apogee" / "v1" / "py.typed").write_text("")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "apogee" / "v1"
        if args.check:
            cmp = filecmp.dircmp(fresh, GENERATED)
            stale = cmp.left_only + cmp.right_only + cmp.diff_files
            if stale:
                print(f"stale generated stubs: {stale}; run scripts/gen_proto.py", file=sys.stderr)
                return 1
            return 0
        if GENERATED.exists():
            shutil.rmtree(GENERATED)
        shutil.copytree(fresh, GENERATED)
    print(f"generated {GENERATED.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
