"""deploy/README.md names every environment variable a deployment may set (issue 18,
item 9: ``KVMESH_HTTP_PORT`` was missing): the compose file's knobs, the systemd units'
variables, the options every service shares (``ServiceConfig``) and the variables the
code reads directly. Test- and launcher-internal variables are exempt."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvmesh.services.common.settings import ServiceConfig

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "deploy" / "README.md").read_text()
# set by the test suite or by `kvmesh up` for its own children, never by an operator
# set by tests, or by `kvmesh up` for the processes it starts (not a deployment's knobs)
INTERNAL = {
    "KVMESH_TEST_HOLD_PREFILL",
    "KVMESH_FAULT_CORRUPT_EVERY",
    "KVMESH_LAUNCHER_PID",
    "KVMESH_LAUNCHER_THREAD_SHARE",
}


def _compose_knobs() -> set[str]:
    return set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", (ROOT / "docker-compose.yml").read_text()))


def _unit_variables() -> set[str]:
    text = "".join(p.read_text() for p in sorted((ROOT / "deploy" / "systemd").iterdir()))
    return set(re.findall(r"\b(KVMESH_[A-Z0-9_]*[A-Z0-9])\b", text))


def _read_by_code() -> set[str]:
    names: set[str] = set()
    for folder in ("services", "rdma"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(
                re.findall(r"\"(KVMESH_[A-Z0-9_]+|OTEL_EXPORTER_OTLP_ENDPOINT)\"", path.read_text())
            )
    return names - INTERNAL


def _shared_options() -> set[str]:
    return {f"KVMESH_{f.name.upper()}" for f in dataclasses.fields(ServiceConfig)}


@pytest.mark.parametrize(
    "source",
    [_compose_knobs, _unit_variables, _read_by_code, _shared_options],
    ids=lambda f: f.__name__,
)
def test_deploy_readme_names_every_variable(source):
    names = source()
    assert names, f"{source.__name__} found nothing: the test reads the wrong place"
    missing = sorted(n for n in names if not re.search(rf"`{n}`", README))
    assert not missing, f"deploy/README.md does not mention {missing}"
