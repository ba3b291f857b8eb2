"""Shared pytest configuration.

Under CI (the environment variable ``CI=true``) a missing test extra fails the run
instead of quietly skipping what needs it:

* at session start, every distribution of ``[project.optional-dependencies] test`` in
  the rootdir's pyproject.toml must be installed, else the run stops with a usage error
  naming the missing ones;
* a skip whose reason says a module or a test extra is missing (``pytest.importorskip``'s
  "could not import ...", or "<test extra> is not installed") is reported as a failure.

Skips for hardware, privileges or system tools that are no test extra (no RDMA device,
no CUDA, no network namespaces, "etcd is not installed") stay skips.
"""

from __future__ import annotations

import os
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

_EXTRAS = pytest.StashKey[frozenset[str]]()
_NOT_INSTALLED = re.compile(r"([A-Za-z0-9][\w.-]*) is not installed")


def _ci() -> bool:
    return os.environ.get("CI") == "true"


def extra_distributions(project: dict, extra: str) -> frozenset[str]:
    """Canonical names of the distributions ``extra`` installs: a requirement on the
    project itself (``kvmesh[engine,dev]``) stands for those extras' requirements."""
    own = canonicalize_name(project.get("name", ""))
    extras = project.get("optional-dependencies", {})
    names: set[str] = set()
    seen: set[str] = set()
    todo = [extra]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for r in map(Requirement, extras.get(name, [])):
            if canonicalize_name(r.name) == own:
                todo.extend(r.extras)
            else:
                names.add(canonicalize_name(r.name))
    return frozenset(names)


def _test_extras(config: pytest.Config) -> frozenset[str]:
    """Canonical names of the ``test`` extra's distributions (empty without a pyproject)."""
    if _EXTRAS not in config.stash:
        path = Path(config.rootpath) / "pyproject.toml"
        data = tomllib.loads(path.read_text()) if path.is_file() else {}
        config.stash[_EXTRAS] = extra_distributions(data.get("project", {}), "test")
    return config.stash[_EXTRAS]


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _ci():
        return
    missing = sorted(n for n in _test_extras(session.config) if not _installed(n))
    if missing:
        raise pytest.UsageError(
            f"CI=true and test extra(s) not installed: {', '.join(missing)} "
            "(pip install -e '.[test]')"
        )


def _says_an_extra_is_missing(reason: str, extras: frozenset[str]) -> bool:
    if "could not import" in reason:
        return True
    m = _NOT_INSTALLED.search(reason)
    return m is not None and canonicalize_name(m.group(1)) in extras


def _skip_to_failure(report: pytest.CollectReport | pytest.TestReport, config) -> None:
    if not (_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    lr = report.longrepr
    reason = lr[2] if isinstance(lr, tuple) else str(lr)
    if _says_an_extra_is_missing(reason, _test_extras(config)):
        report.outcome = "failed"
        report.longrepr = f"CI=true: a missing test extra fails instead of skipping: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    _skip_to_failure(report, item.config)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    _skip_to_failure(report, collector.config)
    return report
