"""What ``pip install .`` puts into site-packages: the one ``kvmesh`` namespace and nothing
else at the top (no generic ``services``, ``rdma``, ``protos`` or ``loadtest``), with every
subpackage, the .proto sources and the vendored data included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"services": "kvmesh.services", "rdma": "kvmesh.rdma", "protos": "kvmesh.protos",
           "loadtest": "kvmesh.loadtest"}  # fmt: skip


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed():
    """A new subpackage that pyproject forgets would be missing from the wheel."""
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    on_disk = {"kvmesh"}
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join([name, *rel]))
    assert on_disk == listed


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the working tree (tracked and new files, as a clone)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp / "dist"
    # without compiling the scheduler (minutes on 2 cores; what a wheel holds is the same
    # but for the .so files; tests/test_conductor_compiled.py covers the compiled modules)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        check=True, capture_output=True, timeout=300,
        env={**os.environ, "KVMESH_PURE_PYTHON": "1"},
    )  # fmt: skip
    (whl,) = out.glob("kvmesh-*.whl")
    return whl


def test_wheel_holds_only_the_kvmesh_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"kvmesh"}
    for required in (
        "kvmesh/__init__.py",
        "kvmesh/__main__.py",
        "kvmesh/services/cli.py",
        "kvmesh/services/conductor/server.py",
        "kvmesh/rdma/tcp.py",
        "kvmesh/protos/kvmesh_pb2_grpc.py",
        "kvmesh/protos/kvmesh.proto",
        "kvmesh/protos/etcd/rpc.proto",
        "kvmesh/loadtest/sim/core.py",
        "kvmesh/loadtest/traces/synthetic_trace.jsonl",
        "kvmesh/loadtest/traces/LICENSE",
        "kvmesh/services/engine/demo/model.safetensors",
        "kvmesh/services/engine/demo/tokenizer.json",
        "kvmesh/services/engine/demo/config.json",
    ):
        assert required in names, required
    assert not any(n.startswith("kvmesh/tests/") for n in names)


def test_install_into_a_fresh_virtualenv(wheel, tmp_path):
    """``pip install`` into a new virtualenv adds only kvmesh* entries to its site-packages,
    and the installed (not editable) package names its modules kvmesh.*."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    before = set(p.name for p in site.iterdir())
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
         "--disable-pip-version-check", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    added = set(p.name for p in site.iterdir()) - before
    assert added and all(n.startswith("kvmesh") for n in added), sorted(added)
    # the protos need only protobuf and grpc; import them from the venv's own copy
    code = "import kvmesh.protos.kvmesh_pb2 as pb; print(pb.__file__)"
    env = {"PYTHONPATH": ":".join(p for p in sys.path if p.endswith("site-packages"))}
    out = subprocess.run(
        [str(py), "-I", "-c", f"import sys; sys.path[1:1] = {env['PYTHONPATH'].split(':')!r}; {code}"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(site)), out.stdout
