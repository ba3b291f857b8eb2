"""The conductor's compiled scheduler (setup.py: Cython over the same ``.py`` files,
typed by the ``.pxd`` beside them) decides exactly as the plain Python modules do, every
field of every decision to the last bit; and a stale build is never used.

The plain modules are loaded side by side from copies of the ``.py`` files
(``bench_conductor.impl_from``), so one process compares both."""

from __future__ import annotations

import os
import random
from collections import deque
from pathlib import Path

import pytest

from kvmesh.loadtest import bench_conductor as bench
from kvmesh.services import conductor
from tests.test_conductor_speed import scenario

HERE = Path(conductor.__file__).parent
COMPILED = bench.impl_here().policy.__file__.endswith(".so")
needs_build = pytest.mark.skipif(
    not COMPILED, reason="the conductor's scheduler is not compiled here (pip install -e .)"
)


def _exact(x: object) -> object:
    """A value as a comparable exact form: numbers by their float's repr (every bit;
    an int and an equal float alike), everything else as it is."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int | float):
        return repr(float(x))
    return x


def _candidate(c) -> tuple:
    return tuple(
        _exact(getattr(c, f))
        for f in (
            "route",
            "node",
            "ttft_ms",
            "queue_ms",
            "prefill_ms",
            "fetch_ms",
            "handoff_ms",
            "cached_blocks",
            "fetch_blocks",
            "work_ms",
            "speed",
        )
    )


def decision_fields(d) -> tuple:
    """Every field of a decision, its estimate and each of its candidates, in order."""
    return (
        d.accepted,
        d.route,
        d.prefill_node,
        d.decode_node,
        _candidate(d.estimate) if d.estimate is not None else None,
        _exact(d.tbt_ms),
        [_candidate(c) for c in d.candidates],
        d.reason,
        d.message,
        _exact(d.retry_after_ms),
    )


def bench_stream(impl, nodes: int, blocks: int, n: int) -> list[tuple]:
    """bench_conductor's workload and loop (decide, commit, the booking of completions
    256 decisions later) on a fixed clock: every decision's fields."""
    s, chains = bench.build(nodes, blocks, random.Random(0), impl)
    t = [1000.0]

    def clock() -> float:
        t[0] += 0.05
        return t[0]

    s.clock = clock
    reqs = bench.requests(chains, n, random.Random(1), impl)
    out, pending = [], deque()
    for r in reqs:
        d = s.decide(r)
        out.append(decision_fields(d))
        if d.accepted:
            s.commit(r, d)
            pending.append((r, d))
            if len(pending) > bench.PENDING:
                bench.book(s, *pending.popleft())
    return out


@needs_build
def test_compiled_decides_as_plain_python_on_the_varied_stream():
    """The recorded stream's workload (every route, every kind of rejection, index
    churn, reports), compared field by field at full precision."""
    plain = bench.impl_from(str(HERE))
    assert not plain.policy.__file__.endswith(".so")
    got = scenario(bench.impl_here(), row=decision_fields)
    want = scenario(plain, row=decision_fields)
    assert len(got) == len(want) == 1000
    assert {row[7] for row in got if not row[0]} >= {"ttft", "tbt", "kv"}
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"decision {i} differs between the compiled and the plain scheduler"


@needs_build
def test_compiled_decides_as_plain_python_on_the_bench_workload():
    plain = bench.impl_from(str(HERE))
    got = bench_stream(bench.impl_here(), 8, 20_000, 3000)
    want = bench_stream(plain, 8, 20_000, 3000)
    assert sum(1 for row in got if row[0]) > 1000  # most are accepted and booked
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"decision {i} differs between the compiled and the plain scheduler"


def test_a_stale_or_partial_build_is_not_used(tmp_path, monkeypatch):
    """Where a source differs from the one its compiled module was built from (the
    build's ``_compiled.json``), or some compiled module is missing, or the stamp is, every
    scheduler module comes from its .py; with all current, the compiled ones, whatever
    the files' times (a wheel install writes a .py after its .so)."""
    import hashlib
    import json

    suffix = ".cpython-311-x86_64-linux-gnu.so"
    monkeypatch.setattr(conductor, "_HERE", tmp_path)
    monkeypatch.setattr(conductor.importlib.machinery, "EXTENSION_SUFFIXES", [suffix])
    assert conductor._compiled_current() is None  # nothing compiled: nothing to say
    sums = {}
    for m in conductor.COMPILED:
        for ext in (".py", ".pxd"):
            (tmp_path / f"{m}{ext}").write_text(f"# {m}{ext}\n")
            sums[f"{m}{ext}"] = hashlib.sha256(f"# {m}{ext}\n".encode()).hexdigest()
        (tmp_path / f"{m}{suffix}").write_text("")
        os.utime(tmp_path / f"{m}{suffix}", (1000, 1000))  # older than every source
    assert conductor._compiled_current() is False  # no stamp: cannot tell
    stamp = tmp_path / "_compiled.json"
    stamp.write_text(json.dumps({"modules": list(conductor.COMPILED), "sha256": sums}))
    assert conductor._compiled_current() is True
    (tmp_path / "estimator.pxd").unlink()  # not installed (a wheel): not compared
    assert conductor._compiled_current() is True
    (tmp_path / "estimator.py").write_text("# changed after the build\n")
    assert conductor._compiled_current() is False
    (tmp_path / "estimator.py").write_text("# estimator.py\n")
    assert conductor._compiled_current() is True
    (tmp_path / f"policy{suffix}").unlink()  # one missing
    assert conductor._compiled_current() is False
