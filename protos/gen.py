"""Regenerate the Python gRPC stubs for every ``protos/**/*.proto``.

Usage (from the repository root)::

    python -m kvmesh.protos.gen

The package installs as ``kvmesh.protos``, so the stubs are generated with
``grpc_tools.protoc`` over a staging tree in which ``kvmesh/protos`` points at this
folder: a proto importing ``"kvmesh/protos/etcd/kv.proto"`` yields Python code
importing ``from kvmesh.protos.etcd import kv_pb2``. ``generate(out_dir)`` writes the
stubs under ``out_dir/protos/`` (tests compare that tree with the committed stubs).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    """All .proto files under protos/, sorted, relative to the repository root."""
    return sorted(p.relative_to(ROOT) for p in PROTO_DIR.rglob("*.proto"))


def generated_files() -> list[Path]:
    """The stub files ``generate`` produces, relative to its output directory."""
    out: list[Path] = []
    for proto in proto_files():
        stem = proto.with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            out.append(stem.with_name(stem.name + suffix))
    return out


def generate(out_dir: Path) -> None:
    """Generate ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for all protos into ``out_dir``."""
    from grpc_tools import protoc

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory(prefix="kvmesh-protoc-") as tmp:
        stage, built = Path(tmp, "include"), Path(tmp, "out")
        (stage / "kvmesh").mkdir(parents=True)
        (stage / "kvmesh" / "protos").symlink_to(PROTO_DIR, target_is_directory=True)
        built.mkdir()
        args = [
            "grpc_tools.protoc",
            f"-I{stage}",
            f"-I{well_known}",
            f"--python_out={built}",
            f"--grpc_python_out={built}",
            f"--pyi_out={built}",
            *(str(stage / "kvmesh" / p) for p in proto_files()),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for rel in generated_files():
            dest = out_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(built / "kvmesh" / rel, dest)


def main() -> int:
    generate(ROOT)
    for f in generated_files():
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
