"""The folder tree's layering rules, checked on the source (every import, including those
inside functions and under ``TYPE_CHECKING``) and on what a service really loads.

The rules (docs/architecture.md says the same in prose):

- no import cycles among kvmesh modules;
- ``services/common`` is the base layer: no torch, no engine, store, rdma or service;
- ``services/engine`` (the model, torch) depends on ``common`` only, never the reverse;
- the conductor and the store-master never import torch or the engine;
- ``rdma`` (the transfer engine) never imports ``services``;
- product code never imports ``loadtest`` (benchmarks and scaffolding) or ``tests``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {
    "kvmesh": "kvmesh",
    "kvmesh.services": "services",
    "kvmesh.rdma": "rdma",
    "kvmesh.protos": "protos",
    "kvmesh.loadtest": "loadtest",
}


@cache
def modules() -> dict[str, Path]:
    """Every kvmesh module by its installed name."""
    out: dict[str, Path] = {}
    for prefix, folder in PACKAGE_DIRS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if prefix == "kvmesh" and len(parts) > 1:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def _imported_names(name: str, path: Path) -> set[str]:
    """Dotted names this module imports anywhere in its body (absolute and relative)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
    return names


@cache
def graph() -> dict[str, frozenset[str]]:
    """Module -> the kvmesh modules and the external top-level packages it imports."""
    mods = modules()
    out: dict[str, frozenset[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for imp in _imported_names(name, path):
            if imp.split(".")[0] != "kvmesh":
                deps.add(imp.split(".")[0])
                continue
            while imp and imp not in mods:
                imp = imp.rpartition(".")[0]
            if imp and imp != name:
                deps.add(imp)
        out[name] = frozenset(deps)
    return out


def cycles(g: dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(d for d in g[root] if d in g)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(d for d in g[w] if d in g))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_cycle():
    g = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset()}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": frozenset({"b"}), "b": frozenset()}) == []


def test_every_module_is_found():
    mods = modules()
    for name in (
        "kvmesh.services.conductor.server",
        "kvmesh.rdma.tcp",
        "kvmesh.protos.kvmesh_pb2",
        "kvmesh.loadtest.sim.core",
        "kvmesh.services.common",
    ):
        assert name in mods


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles (counting function-level and TYPE_CHECKING imports): " + (
        "; ".join(" <-> ".join(c) for c in found)
    )


def _offenders(
    owner: str, banned: tuple[str, ...], g: dict[str, frozenset[str]] | None = None
) -> dict[str, list[str]]:
    bad: dict[str, list[str]] = {}
    for mod, deps in (graph() if g is None else g).items():
        if mod != owner and not mod.startswith(owner + "."):
            continue
        hits = sorted(d for d in deps if any(d == b or d.startswith(b + ".") for b in banned))
        if hits:
            bad[mod] = hits
    return bad


SERVICES = "kvmesh.services"
RULES = {
    # owner package: what it must never import
    f"{SERVICES}.common": (
        "torch",
        "safetensors",
        "kvmesh.rdma",
        f"{SERVICES}.engine",
        f"{SERVICES}.store",
        f"{SERVICES}.store_master",
        f"{SERVICES}.conductor",
        f"{SERVICES}.prefill",
        f"{SERVICES}.decode",
        f"{SERVICES}.model_node",
        f"{SERVICES}.node_config",
        f"{SERVICES}.node_profile",
        f"{SERVICES}.launcher",
        f"{SERVICES}.cli",
        f"{SERVICES}.client",
    ),
    f"{SERVICES}.engine": (
        "kvmesh.rdma",
        f"{SERVICES}.store",
        f"{SERVICES}.store_master",
        f"{SERVICES}.conductor",
        f"{SERVICES}.prefill",
        f"{SERVICES}.decode",
        f"{SERVICES}.model_node",
        f"{SERVICES}.launcher",
        f"{SERVICES}.cli",
    ),
    f"{SERVICES}.conductor": (
        "torch",
        "safetensors",
        f"{SERVICES}.engine",
        f"{SERVICES}.prefill",
        f"{SERVICES}.decode",
        f"{SERVICES}.model_node",
    ),
    f"{SERVICES}.store_master": (
        "torch",
        "safetensors",
        f"{SERVICES}.engine",
        f"{SERVICES}.conductor",
        f"{SERVICES}.prefill",
        f"{SERVICES}.decode",
        f"{SERVICES}.model_node",
    ),
    # torch is optional for rdma: imported inside as_byte_view to accept tensors, never
    # needed (test_entry_module_does_not_load checks it is not loaded)
    "kvmesh.rdma": ("kvmesh.services", "kvmesh.loadtest"),
    "kvmesh.protos": ("kvmesh.services", "kvmesh.rdma", "kvmesh.loadtest"),
    SERVICES: ("kvmesh.loadtest", "tests"),
}


@pytest.mark.parametrize("owner", sorted(RULES))
def test_layer_rule(owner):
    bad = _offenders(owner, RULES[owner])
    assert not bad, f"{owner} must not import {RULES[owner]}; found: {bad}"


def test_layer_rule_catches_a_violation():
    """The rule check itself: a module of common importing the engine is reported."""
    g = {
        "kvmesh.services.common.fake": frozenset({"kvmesh.services.engine.model", "torch", "json"}),
        "kvmesh.services.commonplace": frozenset({"torch"}),  # not inside common
    }
    bad = _offenders(f"{SERVICES}.common", RULES[f"{SERVICES}.common"], g)
    assert bad == {"kvmesh.services.common.fake": ["kvmesh.services.engine.model", "torch"]}


_STORE_MASTER_INSIDE = tuple(
    f"kvmesh.services.store_master.{m}"
    for m in ("server", "metadata", "slots", "fastpath", "fastcalls", "policy")
)

# What a service's entry module really loads (imports run, lazy ones included).
LOADED = [
    ("kvmesh.services.conductor.server", ("torch", "safetensors", "kvmesh.services.engine")),
    ("kvmesh.services.store_master.server", ("torch", "safetensors", "kvmesh.services.engine")),
    ("kvmesh.services.cli", ("torch", "kvmesh.services.engine")),
    # what `kvmesh up` checks --model with before etcd starts (presets, shipped, hub ids)
    ("kvmesh.services.engine.model_spec", ("torch", "safetensors")),
    ("kvmesh.services.common", ("torch",)),
    ("kvmesh.rdma", ("kvmesh.services", "torch")),
    # the model nodes load the engine (torch), never another service's code; the store
    # client speaks the store-master's wire format (store_master.wire), nothing more of it
    (
        "kvmesh.services.prefill.server",
        (
            "kvmesh.services.conductor",
            *_STORE_MASTER_INSIDE,
            "kvmesh.services.decode",
            "kvmesh.loadtest",
        ),
    ),
    (
        "kvmesh.services.decode.server",
        (
            "kvmesh.services.conductor",
            *_STORE_MASTER_INSIDE,
            "kvmesh.services.prefill",
            "kvmesh.loadtest",
        ),
    ),
]


@pytest.mark.parametrize(("entry", "absent"), LOADED, ids=[e for e, _ in LOADED])
def test_entry_module_does_not_load(entry, absent):
    code = (
        "import sys, importlib; importlib.import_module(sys.argv[1]); "
        "print('\\n'.join(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, entry],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        check=True,
    ).stdout.split()
    loaded = sorted(m for m in out if any(m == a or m.startswith(a + ".") for a in absent))
    assert not loaded, f"importing {entry} loaded {loaded}"


def _private_names(tree: ast.AST) -> set[str]:
    """Underscore names a module defines: functions, classes, and attributes it assigns."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reaches(trees: dict[str, ast.AST]) -> list[str]:
    """``obj._name`` reads (obj not self/cls) of a private name that another kvmesh module
    defines and this one does not: one module reaching into another's private state."""
    defined = {mod: _private_names(tree) for mod, tree in trees.items()}
    everywhere = set().union(*defined.values()) if defined else set()
    found = []
    for mod, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            if node.attr.startswith("__") or node.attr in defined[mod]:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in everywhere:
                found.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another_modules_private_state():
    trees = {
        name: ast.parse(path.read_text())
        for name, path in modules().items()
        if not name.startswith("kvmesh.protos")
    }
    found = private_reaches(trees)
    assert not found, "private state read across modules (give it a public interface): " + (
        "; ".join(found)
    )


def test_private_reach_check_finds_one():
    a = ast.parse("class A:\n    def __init__(self):\n        self._lock = 1\n")
    b = ast.parse("def f(a):\n    return a._lock, a._replace(), self_._lock\n")
    assert private_reaches({"m.a": a, "m.b": b}) == ["m.b:2: a._lock", "m.b:2: self_._lock"]
    assert private_reaches({"m.a": a}) == []
