"""Generate libs/apogee-proto: Python messages, gRPC stubs and their type stubs.

    uv run python scripts/gen_proto.py           # regenerate
    uv run python scripts/gen_proto.py --check   # fail if the committed stubs are stale

Three protocols:

- ``apogee.v1``, the internal one, from ``proto/apogee/v1``;
- ``apogee.etcd``, the part of etcd's v3 API that the brokers call to keep a replica group's
  record (:mod:`apogee.service.etcd`), from ``proto/apogee/etcd``: etcd's own definitions,
  trimmed (their packages ``etcdserverpb`` and ``mvccpb`` kept, so the wire format and the
  method paths are etcd's);
- ``apogee.rocketmq.v2``, the public ``apache.rocketmq.v2`` of the official RocketMQ 5 clients,
  from the descriptors that the official Python client (``rocketmq-python-client``, pinned in
  the dev dependencies) ships. They are read from its files without importing the package
  (importing it starts the client's logging in ``$HOME``). The descriptors are kept byte for
  byte, file names included, so a process that loads both the client and these stubs holds one
  definition of each message; only the Python import of ``definition_pb2`` is moved into the
  ``apogee.rocketmq.v2`` package.

The generated files are committed (services install them without protoc) and never edited.
"""

from __future__ import annotations

import argparse
import ast
import filecmp
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from google.protobuf import descriptor_pb2, duration_pb2, timestamp_pb2

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
OUT = ROOT / "libs" / "apogee-proto" / "src"
GENERATED = OUT / "apogee" / "v1"
ETCD = OUT / "apogee" / "etcd"
V2 = OUT / "apogee" / "rocketmq" / "v2"
#: the official client whose descriptors the v2 stubs are generated from
V2_SOURCE = "rocketmq-python-client"
V2_FILES = ("definition", "service")


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
    for package in ("v1", "etcd"):
        (into / "apogee" / package / "py.typed").write_text("")


def v2_descriptors() -> bytes:
    """The FileDescriptorSet of ``apache.rocketmq.v2`` (with the well-known types it imports),
    read from the official client's generated files."""
    dist = metadata.distribution(V2_SOURCE)
    fds = descriptor_pb2.FileDescriptorSet()
    for wkt in (timestamp_pb2, duration_pb2):
        fds.file.add().ParseFromString(wkt.DESCRIPTOR.serialized_pb)
    for name in V2_FILES:
        src = Path(str(dist.locate_file(f"rocketmq/grpc_protocol/{name}_pb2.py"))).read_text()
        found = re.search(r"AddSerializedFile\((b'.*?')\)", src, re.S)
        if found is None:
            raise SystemExit(f"no serialized descriptor in {V2_SOURCE}'s {name}_pb2.py")
        fds.file.add().ParseFromString(ast.literal_eval(found.group(1)))
    return fds.SerializeToString()


def generate_v2(into: Path) -> None:
    out = into / "apogee" / "rocketmq" / "v2"
    out.mkdir(parents=True)
    bindir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        descriptors = Path(tmp) / "v2.pb"
        descriptors.write_bytes(v2_descriptors())
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--descriptor_set_in={descriptors}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_out={out}",
            f"--mypy_grpc_out={out}",
            f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
            *(f"{name}.proto" for name in V2_FILES),
        ]
        subprocess.run(cmd, check=True, capture_output=True)
    package = "apogee.rocketmq.v2"
    for path in out.iterdir():
        text = path.read_text()
        for name in V2_FILES:
            text = re.sub(
                rf"^import {name}_pb2 as ",
                f"from {package} import {name}_pb2 as ",
                text,
                flags=re.M,
            )
        path.write_text(text)
    (out / "py.typed").write_text("")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        generate_v2(Path(tmp))
        pairs = [
            (Path(tmp) / "apogee" / "v1", GENERATED),
            (Path(tmp) / "apogee" / "etcd", ETCD),
            (Path(tmp) / "apogee" / "rocketmq" / "v2", V2),
        ]
        if args.check:
            stale: list[str] = []
            for fresh, committed in pairs:
                if not committed.exists():
                    stale.append(str(committed.relative_to(ROOT)))
                    continue
                cmp = filecmp.dircmp(fresh, committed, ignore=["__pycache__"])
                stale += cmp.left_only + cmp.right_only + cmp.diff_files
            if stale:
                print(f"stale generated stubs: {stale}; run scripts/gen_proto.py", file=sys.stderr)
                return 1
            return 0
        for fresh, committed in pairs:
            if committed.exists():
                shutil.rmtree(committed)
            shutil.copytree(fresh, committed)
            print(f"generated {committed.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
