"""Regenerate the Python gRPC stubs for every ``protos/**/*.proto``.

Usage (from the repository root)::

    python -m protos.gen

The stubs are generated with ``grpc_tools.protoc`` using the repository root as
the include path, so a proto importing ``"protos/etcd/kv.proto"`` yields Python
code importing ``from protos.etcd import kv_pb2``. ``generate(out_dir)`` writes
the same tree elsewhere (tests compare it with the committed stubs).
"""

from __future__ import annotations

import sys
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
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *(str(ROOT / p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


def main() -> int:
    generate(ROOT)
    for f in generated_files():
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
