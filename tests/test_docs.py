"""The documentation in docs/ stays true to the code.

- docs/configuration.md is generated from the config dataclasses and must equal what
  ``python scripts/gen_config_docs.py`` writes now;
- every service config class is in it, read under the TOML table the page names;
- every ``kvmesh_*`` and ``vllm:*`` metric is listed in docs/operations.md;
- repository paths quoted in the docs and the README exist, and their links resolve;
- nothing points outside the repository;
- the vendored trace is where ``loadtest.workload`` looks for it, unchanged.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GENERATOR = ROOT / "scripts" / "gen_config_docs.py"
REGENERATE = "python scripts/gen_config_docs.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", GENERATOR)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_config_docs", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gen():
    pytest.importorskip("torch")  # the prefill and decode configs live beside the engine
    return _generator()


def test_configuration_doc_is_fresh(gen):
    committed = (DOCS / "configuration.md").read_text()
    assert committed == gen.render(), (
        f"docs/configuration.md is stale (the config dataclasses changed): run `{REGENERATE}`"
        " and commit the result"
    )


def test_every_service_config_is_documented(gen):
    documented = {s.cls.__name__ for s in gen.sections()}
    declared = set()
    for path in (ROOT / "services").rglob("*.py"):
        declared.update(
            re.findall(
                r"^class (\w+Config)\((?:ServiceConfig|NodeConfig)\)", path.read_text(), re.M
            )
        )
    missing = declared - documented
    assert not missing, (
        f"config classes {sorted(missing)} are not in docs/configuration.md: add them to "
        f"sections() in scripts/gen_config_docs.py and run `{REGENERATE}`"
    )


def test_toml_tables_match_the_services(gen):
    for s in gen.sections():
        if s.toml_section is None:
            continue
        # the config's own module, or its service's entry module beside it (``server``)
        mods = [s.cls.__module__, s.cls.__module__.rsplit(".", 1)[0] + ".server"]
        source = "".join(
            inspect.getsource(importlib.import_module(m))
            for m in mods
            if importlib.util.find_spec(m) is not None
        )
        assert f'section="{s.toml_section}"' in source, (
            f"{s.cls.__name__}: docs/configuration.md says TOML table [{s.toml_section}], "
            f"but {' and '.join(mods)} load its config under another section"
        )


def test_every_metric_is_documented():
    ops = (DOCS / "operations.md").read_text()
    names = set()
    for rel in (
        "services/common/metrics.py",
        "services/conductor/model_metrics.py",
        "services/conductor/vllm_metrics.py",
    ):
        text = (ROOT / rel).read_text()
        names.update(
            re.findall(
                r'(?:Counter|Histogram|Gauge|Summary|MetricFamily)\(\s*"((?:kvmesh_|vllm:)[\w:]+)"',
                text,
            )
        )
    assert len(names) > 10, "the metric scan found too little; update this test"
    missing = sorted(n for n in names if f"`{n}" not in ops)
    assert not missing, f"metrics missing from the table in docs/operations.md: {missing}"


def _doc_files() -> list[Path]:
    return sorted(DOCS.glob("*.md")) + [ROOT / "README.md", ROOT / "CHANGELOG.md"]


def test_quoted_paths_and_links_exist():
    path_re = re.compile(
        r"`((?:docs|services|rdma|protos|loadtest|deploy|tests|scripts|kvmesh)/[\w./-]*)`"
    )
    link_re = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    bad = []
    for doc in _doc_files():
        text = doc.read_text()
        for p in path_re.findall(text):
            if not (ROOT / p).exists():
                bad.append(f"{doc.name}: `{p}`")
        for link in link_re.findall(text):
            if "://" in link:
                continue
            if not (doc.parent / link).exists():
                bad.append(f"{doc.name}: link ({link})")
    assert not bad, "the docs name paths that do not exist: " + ", ".join(bad)


def test_nothing_points_outside_the_repository():
    needles = ("../" + "shared", "/work/" + "shared")  # split so this file does not match
    skip = {".git", "build", "dist", "__pycache__", ".venv", "node_modules"}
    hits = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in skip or part.endswith(".egg-info") for part in rel.parts):
            continue
        if not path.is_file() or path.suffix not in {".py", ".md", ".toml", ".yml", ".sh", ""}:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        hits += [f"{rel}" for n in needles if n in text]
    assert not hits, f"files refer to paths outside the repository: {sorted(set(hits))}"


def test_vendored_trace_is_the_default():
    from kvmesh.loadtest import workload

    trace = Path(workload.DEFAULT_TRACE)
    assert trace.is_file(), f"{trace} is missing (it ships in loadtest/traces/)"
    assert trace.parent == Path(workload.__file__).resolve().parent / "traces"
    readme = (trace.parent / "README.md").read_text()
    digest = hashlib.sha256(trace.read_bytes()).hexdigest()
    assert f"sha256 {digest}" in readme, "the trace differs from the one its README describes"
    assert (trace.parent / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_licence_matches_pyproject():
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert "Apache-2.0" in (ROOT / "pyproject.toml").read_text()
