"""The evaluation at equal compute (loadtest.capacity): the capacity search on a known
curve, the configurations' budgets, and the whole evaluation made small on real
budgeted clusters."""

from __future__ import annotations

import json

import pytest

from kvmesh.loadtest.capacity import search_capacity
from kvmesh.loadtest.capacity_report import headline
from kvmesh.loadtest.eval_cluster import Setup, budget_configs
from kvmesh.services.common import cpu_budget


def _curve(knee: float):
    """Attainment 1.0 up to ``knee`` rps, then falling linearly to 0 at 2x the knee."""
    return lambda rate, k: 1.0 if rate <= knee else max(0.0, 1.0 - (rate - knee) / knee)


@pytest.mark.parametrize("start", [0.5, 4.0, 40.0])
def test_the_search_brackets_the_knee_from_below_above_or_far_away(start):
    got = search_capacity(_curve(4.0), start, probes=10, log=lambda *_: None)
    assert got["bracketed"]
    lo, hi = got["bracket"]
    assert lo <= 4.4 and hi > 4.4 and lo < hi  # 90% is crossed at 4.4 rps
    assert hi / lo < 1.15  # bisection narrowed it
    assert got["capacity_rps"] == pytest.approx(4.4, rel=0.05)
    assert len(got["probes"]) == 10


def test_a_miss_below_a_rate_that_held_does_not_lower_the_capacity():
    seq = iter([1.0, 0.5, 1.0, 0.0])  # 2 holds, 3 misses (noise), 4.5 holds, 6.75 misses
    got = search_capacity(lambda r, k: next(seq), 2.0, probes=4, log=lambda *_: None)
    rates = [p["rate"] for p in got["probes"]]
    assert rates[0] == 2.0 and rates[1] == pytest.approx(3.0)
    # after the miss at 3, the search bisects (2, 3); its probe holds, so the bracket is
    # (that rate, 3) and the capacity is between them, never below 2
    assert got["bracket"][0] >= 2.0
    assert got["capacity_rps"] >= 2.0


def test_a_search_that_never_holds_reports_zero():
    got = search_capacity(lambda r, k: 0.5, 1.0, probes=3, log=lambda *_: None)
    assert got["capacity_rps"] == 0.0 and not got["bracketed"]
    assert [p["rate"] for p in got["probes"]] == pytest.approx([1.0, 1 / 1.5, 1 / 2.25], abs=1e-3)


def test_every_configuration_has_the_same_node_compute():
    s = Setup(cpus=0.375, control_cpus=0.3)
    cfgs = budget_configs(s, 4, [(1, 3), (2, 2), (3, 1)])
    assert set(cfgs) == {
        "colocated",
        *(f"{k}-{p}p{d}d" for k in ("kvmesh", "nostore") for p, d in [(1, 3), (2, 2), (3, 1)]),
    }
    for name, c in cfgs.items():
        assert len(c["working"]) == 4, name
        assert c["pin"] == {}
        if name != "colocated":
            assert c["prefill"] + c["decode"] == 4
    assert cfgs["colocated"]["decode"] == 4
    with pytest.raises(ValueError, match="summing to 4"):
        budget_configs(s, 4, [(2, 3)])


def test_the_headline_compares_the_best_kvmesh_median_with_colocated():
    def s(cfg, rps):
        return {"workload": "trace", "config": cfg, "capacity_rps": rps}

    res = {
        "searches": [
            s("colocated", 2.0),
            s("colocated", 3.0),
            s("colocated", 2.5),
            s("kvmesh-1p3d", 2.0),
            s("kvmesh-2p2d", 4.0),
            s("kvmesh-2p2d", 3.5),
            s("kvmesh-2p2d", 3.6),
        ]
    }
    h = headline(res, "trace")
    assert h["kvmesh"] == "kvmesh-2p2d"
    assert h["ratio"] == pytest.approx(3.6 / 2.5)
    assert h["lowest_above_highest"]  # 3.5 > 3.0
    assert headline(res, "shared") is None


WHY = cpu_budget.support()


@pytest.mark.skipif(bool(WHY), reason=f"no CPU budgets here: {WHY}")
def test_the_quick_evaluation_runs_every_phase_under_budgets(tmp_path):
    from kvmesh.loadtest.capacity import main

    assert main(["--quick", "--nodes", "2", "--probe-requests", "8", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "capacity.json").read_text())
    seen = {(s["workload"], s["config"]) for s in res["searches"]}
    for w in ("trace", "shared"):
        assert {(w, "colocated"), (w, "kvmesh-1p1d"), (w, "nostore-1p1d")} <= seen
    for w in ("long", "decode"):
        assert (w, "colocated") in seen and (w, "kvmesh-1p1d") in seen
    assert res["workloads"]["decode"]["output_mean"] > res["workloads"]["trace"]["output_mean"]
    assert res["workloads"]["long"]["input_mean"] > res["workloads"]["decode"]["input_mean"]
    for s in res["searches"]:
        assert s["runs"], s["config"]
        for r in s["runs"]:
            assert r["summary"]["requests"] == 8
            nodes = {n for n in r["cpu"] if n != "control-plane"}
            # every model node reports its CPU within its budget (the quota holds)
            assert len(nodes) >= 2
            for n in nodes:
                assert 0 <= r["cpu"][n]["share_of_budget"] <= 1.05, (s["config"], n, r["cpu"])
            assert "control-plane" in r["cpu"]
    text = (tmp_path / "capacity.md").read_text()
    assert "## Headline" in text and "CPU against budget" in text
    assert (tmp_path / "capacity_curves.png").stat().st_size > 1000
