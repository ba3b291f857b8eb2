"""tests/conftest.py under CI=true: a missing test extra fails the run, a missing piece
of hardware still skips. Runs pytest in a subprocess on tiny test files with a copy of
the conftest and a pyproject of its own."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

CONFTEST = Path(__file__).with_name("conftest.py")
PYPROJECT = """\
[project]
name = "ci-extras-probe"
version = "0"

[project.optional-dependencies]
test = [{extras}]

[tool.pytest.ini_options]
"""
TESTS = """\
import pytest

def test_missing_module():
    pytest.importorskip("kvmesh_no_such_module")

def test_missing_extra_tool():
    pytest.skip("pytest is not installed")  # pytest is in the probe's test extra

def test_no_hardware():
    pytest.skip("no usable RDMA device: none found")

def test_missing_system_tool():
    pytest.skip("etcd is not installed")  # not a test extra

def test_fine():
    pass
"""
MODULE_SKIP = """\
import pytest

pytest.importorskip("kvmesh_no_such_module")

def test_never_collected():
    pass
"""


def run_probe(tmp_path: Path, ci: bool, extras: str = '"pytest>=8"') -> tuple[int, str]:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pyproject.toml").write_text(PYPROJECT.format(extras=extras))
    (tmp_path / "test_probe.py").write_text(TESTS)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    if ci:
        env["CI"] = "true"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rfEs",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.returncode, out.stdout + out.stderr


def summary(text: str) -> dict[str, int]:
    last = text.strip().splitlines()[-1]
    return {k: int(n) for n, k in re.findall(r"(\d+) (\w+)", last)}


def test_without_ci_missing_extras_skip(tmp_path):
    rc, text = run_probe(tmp_path, ci=False)
    assert rc == 0, text
    assert summary(text) == {"passed": 1, "skipped": 5}, text


def test_under_ci_missing_extras_fail_and_hardware_skips_stay(tmp_path):
    rc, text = run_probe(tmp_path, ci=True)
    assert rc == 1, text
    assert summary(text) == {"failed": 2, "passed": 1, "skipped": 2, "error": 1}, text
    assert re.search(r"FAILED test_probe.py::test_missing_module", text), text
    assert re.search(r"FAILED test_probe.py::test_missing_extra_tool", text), text
    assert re.search(r"ERROR test_module_skip.py", text), text
    assert "no usable RDMA device" in text and "etcd is not installed" in text  # skipped


def test_under_ci_an_uninstalled_test_extra_stops_the_run(tmp_path):
    rc, text = run_probe(tmp_path, ci=True, extras='"pytest>=8", "kvmesh-no-such-dist>=1"')
    assert rc == pytest.ExitCode.USAGE_ERROR, text
    assert "kvmesh-no-such-dist" in text and "passed" not in text, text
    rc, text = run_probe(tmp_path, ci=False, extras='"pytest>=8", "kvmesh-no-such-dist>=1"')
    assert rc == 0, text


def test_the_test_extra_counts_what_its_own_extras_install():
    """``kvmesh[engine,dev]`` inside the test extra stands for torch, grpcio-tools, ...:
    a missing torch must fail a CI run, not pass as the installed ``kvmesh``."""
    import tomllib
    from pathlib import Path

    from tests.conftest import extra_distributions

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    names = extra_distributions(project["project"], "test")
    assert {"torch", "safetensors", "grpcio-tools", "ruff", "mypy", "pytest"} <= names
    assert "kvmesh" not in names
    fake = {
        "name": "p",
        "optional-dependencies": {"a": ["p[b]", "x"], "b": ["p[a]", "y>=1"]},  # a cycle
    }
    assert extra_distributions(fake, "a") == {"x", "y"}
