"""loadtest: trace -> tokens, workload shapes, metrics, the simulator (real policy code),
and one small replay through a real cluster checked against the single-process model."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvmesh.loadtest import metrics as M
from kvmesh.loadtest import workload as W
from kvmesh.loadtest.sim.core import SimConfig, simulate


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_trace_tokens_share_exactly_the_shared_blocks():
    recs = [
        {"timestamp": 0, "input_length": 2048, "output_length": 10, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 100, "input_length": 2048, "output_length": 20, "hash_ids": [1, 2, 9, 10]},
        {"timestamp": 250, "input_length": 1300, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 300, "input_length": 1024, "output_length": 5, "hash_ids": [7, 8]},
    ]
    items = W.trace_items(recs, block_tokens_n=32, time_scale=2.0, seed=3)
    bs = 32
    assert [len(i.token_ids) for i in items] == [128, 128, round(1300 / 16), 64]
    assert [i.t_ms for i in items] == [0, 200, 500, 600]
    assert all(0 <= t < 256 for i in items for t in i.token_ids)
    for a in items:
        for b in items:
            if a is b:
                continue
            shared = _common_prefix(a.hash_ids, b.hash_ids)
            cp = _common_prefix(a.token_ids, b.token_ids)
            # exactly the shared blocks are equal, and the next block differs at once
            assert cp // bs == shared or cp == min(len(a.token_ids), len(b.token_ids))
            assert cp < (shared + 1) * bs
    # the same id gives the same block whatever the request; the seed changes it
    assert items[0].token_ids[:64] == items[2].token_ids[:64]
    assert W.trace_items(recs, seed=4)[0].token_ids != items[0].token_ids
    # deterministic
    assert W.trace_items(recs, block_tokens_n=32, seed=3)[1].token_ids == items[1].token_ids
    # outputs scale with the length scale, clamped
    assert [i.max_tokens for i in items] == [1, 1, 1, 1]
    assert W.trace_items(recs, output_scale=1.0, max_output=15)[1].max_tokens == 15
    assert len(W.trace_items(recs, max_requests=2, offset=1)) == 2


def test_agentic_workload_shape():
    items = W.agentic_items(3, seed=1)
    s = W.summarize(items)
    by: dict[str, list[W.Item]] = {}
    for it in items:
        by.setdefault(it.session, []).append(it)
    assert len(by) == 3
    for turns in by.values():
        assert len(turns) >= 30
        for prev, cur in zip(turns, turns[1:]):
            # the next prompt starts with the previous prompt + its output
            ctx = prev.token_ids + prev.planned_output
            assert cur.token_ids[: len(ctx)] == ctx
            assert cur.token_ids == W.turn_prompt(prev.token_ids, prev.planned_output, cur.new_ids)
            growth = len(cur.token_ids) - len(prev.token_ids)
            assert 60 <= growth <= 160  # ~2,000 tokens x 1/20 a turn, + output
        assert len(turns[-1].token_ids) + turns[-1].max_tokens <= 4000
    assert 100 <= s["input_output_ratio"] <= 170
    assert s["session_prefix_share"] > 0.9
    chat = W.chat_items(4, seed=2)
    assert {i.session for i in chat} and all(i.max_tokens >= 8 for i in chat)
    assert W.agentic_items(3, seed=1)[5].token_ids == items[5].token_ids


def test_metrics_on_synthetic_records():
    recs = [
        {
            "status": "OK",
            "ttft_ms": 100.0,
            "token_times_ms": [100, 110, 120, 130],
            "prompt_tokens": 100,
            "cached_tokens": 60,
            "computed_tokens": 40,
            "sent_ms": 0,
            "e2e_ms": 130,
            "route": "disaggregated",
            "completion_tokens": 4,
        },
        {
            "status": "OK",
            "ttft_ms": 300.0,
            "token_times_ms": [300, 340, 340],
            "prompt_tokens": 100,
            "cached_tokens": 0,
            "computed_tokens": 100,
            "sent_ms": 500,
            "e2e_ms": 340,
            "route": "colocated",
            "completion_tokens": 3,
        },
        {
            "status": "RESOURCE_EXHAUSTED",
            "reject_reason": "ttft",
            "sent_ms": 1000,
            "prompt_tokens": 100,
        },
        {
            "status": "OK",
            "ttft_ms": 2000.0,
            "token_times_ms": [2000],
            "prompt_tokens": 50,
            "cached_tokens": 50,
            "computed_tokens": 0,
            "sent_ms": 1500,
            "e2e_ms": 2000,
            "completion_tokens": 1,
        },
    ]
    assert M.tbt_gaps([100, 110, 120, 130]) == [10, 10, 10]
    assert M.tbt_gaps([300, 340, 340]) == [20, 20]  # one chunk of 2 shares its gap
    s = M.summarize(recs, ttft_slo_ms=500, tbt_slo_ms=15)
    assert s["requests"] == 4 and s["served"] == 3 and s["rejected"] == 1
    assert s["acceptance_rate"] == 0.75
    assert s["rejected_by_reason"] == {"ttft": 1}
    # SLO: #1 ok (ttft 100, tbt 10); #2 tbt 20 > 15; #4 ttft 2000 > 500
    assert s["slo_attainment"] == 0.25
    assert s["slo_attainment_accepted"] == round(1 / 3, 4)
    assert s["duration_s"] == 3.5  # 0 .. 1500 + 2000 ms
    assert s["goodput_rps"] == round(1 / 3.5, 4)
    assert s["cache_hit_ratio"] == round(110 / 250, 4)
    assert s["prefill_tokens_avoided"] == 110
    assert s["ttft_ms"]["p50"] == 300.0
    assert s["tbt_ms"]["p50"] == 10.0 and s["tbt_ms"]["p99"] == pytest.approx(20.0, abs=0.5)
    assert M.quantile([1, 2, 3, 4], 0.5) == 2.5 and M.quantile([], 0.5) is None
    assert M.ratio(1, 4) == 0.25 and M.ratio(1, 0) is None


def _loaded_trace(n=400, seed=0):
    """Groups of requests sharing long prefixes, arriving faster than 2 prefill nodes can
    compute them without the cache."""
    rng = random.Random(seed)
    prefixes = [[rng.getrandbits(40) for _ in range(24)] for _ in range(10)]
    out, t = [], 0.0
    for _i in range(n):
        p = rng.choice(prefixes)
        k = rng.randint(16, 24)
        ids = p[:k] + [rng.getrandbits(40) for _ in range(4)]
        t += rng.expovariate(1 / 350.0)
        out.append(
            {
                "timestamp": t,
                "input_length": len(ids) * 512 - 100,
                "output_length": rng.randint(20, 200),
                "hash_ids": ids,
            }
        )
    return out


def test_the_knee_search_brackets_then_bisects_and_averages_seeds():
    """The knee (colocated's highest rate with >= 90% inside): x1.6 steps until a rate
    that holds lies below one that does not, then bisection of that bracket, each probe
    the mean over its seeds; a miss below a rate that held (noise) bounds nothing."""
    from kvmesh.loadtest.eval import find_knee

    class Fake:  # attainment falls linearly from 1.0 at 10 rps to 0.5 at 20 rps
        def __init__(self, noise=None):
            self.calls: list[tuple[float, int]] = []
            self.noise = noise or {}

        def run(self, items, label=""):
            rate, seed = items
            self.calls.append((rate, seed))
            att = min(1.0, max(0.0, 1.0 - 0.05 * (rate - 10.0)))
            att += self.noise.get(seed, 0.0)
            return {
                "config": "colocated",
                "label": label,
                "wall_s": 0.0,
                "summary": {
                    "served": 1, "requests": 1, "rejected": 0, "failed": 0,
                    "ttft_ms": {"p50": 1, "p90": 1}, "tbt_ms": {"p99": 1},
                    "slo_attainment": att, "slo_attainment_accepted": att,
                    "goodput_rps": rate, "cache_hit_ratio": 0.0,
                },
            }  # fmt: skip

    def make(rate, seed):
        return (rate, seed)

    cc = Fake()
    k = find_knee(cc, make, 8.0, 6, lambda m: None, seeds=2)
    # 8 rps holds (1.0), 12.8 misses (0.86): bracketed; the true knee is 12 rps
    assert k["bracketed"] and k["seeds"] == 2
    assert len(cc.calls) == 12 and len({s for _, s in cc.calls}) == 12  # own workloads
    assert {s for _, s in cc.calls} == {900 + 100 * k + j for k in range(6) for j in (0, 1)}
    rates = [p["rate"] for p in k["probes"]]
    assert rates[:2] == [8.0, 12.8]
    assert rates[2] == pytest.approx((8.0 * 12.8) ** 0.5, abs=1e-3)  # bisection
    assert all(min(rates[:2]) <= r <= max(rates[:2]) for r in rates[2:])
    assert k["knee_rps"] == pytest.approx(12.0, abs=0.05)  # linear between the bracket
    # one seed of the probe at 8 rps far off: the mean of two still holds
    noisy = Fake({900: -0.15})
    k2 = find_knee(noisy, make, 8.0, 6, lambda m: None, seeds=2)
    assert k2["probes"][0]["attainment"] == pytest.approx(0.925)
    assert k2["knee_rps"] == pytest.approx(12.0, abs=0.05)
    # every rate holds: ever higher, and the highest is a lower bound (not bracketed)
    k3 = find_knee(Fake(), make, 1.0, 3, lambda m: None, seeds=1)
    assert [p["rate"] for p in k3["probes"]] == pytest.approx([1.0, 1.6, 2.56])
    assert k3["knee_rps"] == pytest.approx(2.56) and not k3["bracketed"]
    # none holds: ever lower, and the knee is below the lowest rate probed
    k4 = find_knee(Fake(), make, 40.0, 2, lambda m: None, seeds=1)
    assert [p["rate"] for p in k4["probes"]] == pytest.approx([40.0, 25.0])
    assert k4["knee_rps"] == pytest.approx(25.0 / 1.6) and not k4["bracketed"]
    # a probe that misses by noise makes the search go lower: the bracket is where the
    # probes say, the knee below the noisy rate (one seed: nothing averages it out)
    k5 = find_knee(Fake({900: -0.5}), make, 8.0, 4, lambda m: None, seeds=1)
    assert [p["rate"] for p in k5["probes"]][:2] == pytest.approx([8.0, 5.0])
    assert k5["bracketed"] and 5.0 < k5["knee_rps"] < 8.0


def test_simulator_deterministic_and_kvmesh_beats_random_under_load():
    trace = _loaded_trace()
    cfg = SimConfig(prefill_nodes=2, decode_nodes=2, ttft_slo_ms=8000, tbt_slo_ms=100)
    out = {}
    for pol in ("random", "kvmesh"):
        a = simulate(trace, SimConfig(**{**cfg.__dict__, "policy": pol}))
        b = simulate(trace, SimConfig(**{**cfg.__dict__, "policy": pol}))
        ra, rb = a.records(), b.records()
        assert ra == rb  # deterministic
        out[pol] = M.summarize(ra, ttft_slo_ms=8000, tbt_slo_ms=100)
        assert out[pol]["served"] + out[pol]["rejected"] == len(trace)
    r, k = out["random"], out["kvmesh"]
    assert r["rejected"] > 0  # the scenario is loaded
    assert k["rejected"] < r["rejected"]
    assert k["slo_attainment"] > r["slo_attainment"]
    assert k["cache_hit_ratio"] >= r["cache_hit_ratio"]
    # admitted requests keep their SLOs under kvmesh (estimates are calibrated)
    assert k["slo_attainment_accepted"] >= 0.95


@pytest.mark.timeout(120)
def test_small_real_cluster_replay_matches_reference(tmp_path):
    from kvmesh.loadtest.driver import drive
    from kvmesh.services.engine.model import LlamaModel
    from kvmesh.services.launcher import LocalCluster

    recs = [
        {
            "timestamp": i * 150,
            "input_length": 512 * (2 + i % 3) - 7 * i,
            "output_length": 8 * 16,
            "hash_ids": [1, 2, 3, 4][: 2 + i % 3]
            if i % 2
            else [10 + i, 20 + i, 30 + i, 40 + i][: 2 + i % 3],
        }
        for i in range(8)
    ]
    items = W.trace_items(recs, block_tokens_n=32, max_output=8)
    with LocalCluster(
        str(tmp_path / "c"),
        node_args=[
            "--model",
            "tiny",
            "--block-size",
            "16",
            "--kv-memory",
            "16MiB",
            "--segment-memory",
            "16MiB",
        ],
        http_port=-1,
    ) as c:
        got = asyncio.run(drive(c.conductor, items, timeout=60))
    model = LlamaModel.from_preset("tiny")
    finished = [r for r in got if r.status == "OK"]
    assert len(finished) >= 6
    for it, r in zip(items, got):
        if r.status != "OK":
            continue
        assert r.tokens == model.reference_generate(it.token_ids, it.max_tokens, eos_id=257), it.rid
        assert r.ttft_ms is not None and r.prompt_tokens == len(it.token_ids)
    assert any(r.cached_tokens > 0 for r in finished)  # the shared blocks were reused


@pytest.mark.timeout(600)
def test_eval_quick_compares_three_configs_on_pinned_nodes(tmp_path):
    """`python -m kvmesh.loadtest --quick`, made small (tiny model, the trace at one
    load): every configuration ran on its two pinned nodes, the report names all three,
    and every hit ratio is one the workload allows (never above an infinite cache's)."""
    import json
    import os

    from kvmesh.loadtest.eval import main

    out = tmp_path / "out"
    rc = main(
        [
            "--quick",
            "--model",
            "tiny",
            "--phases",
            "trace",
            "--knee-start",
            "3",
            "--loads",
            "1",
            "--requests",
            "10",
            "--trace-sample",
            "4",  # a group sample whose first 10 requests reuse blocks (ideal 49%)
            "--ttft-slo-ms",
            "30000",  # admission is not under test here: every request is served
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    ev = json.loads((out / "eval.json").read_text())
    trace = [r for r in ev["runs"] if r["workload"] == "trace"]
    assert sorted(r["config"] for r in trace) == ["colocated", "disagg-nostore", "kvmesh"]
    two = len(os.sched_getaffinity(0)) > 1
    for name, c in ev["clusters"].items():
        cores = [v for k, v in c["affinity"].items() if k != "prefill-0" or name != "colocated"]
        assert all(len(v) == 1 for v in cores), c  # each working node on one core
        if two:
            assert len({v[0] for v in cores}) == 2, c  # and not the same one
    for r in trace:
        s = r["summary"]
        assert s["served"] + s["rejected"] + s["failed"] == s["requests"] == 10
        assert s["failed"] == 0, r["label"]
        # a cache never serves more than an infinite one could
        assert s["cache_hit_ratio"] <= r["ideal_hit_ratio"] + 1e-6, r["label"]
        served_prompt = sum(x["prompt_tokens"] for x in r["records"] if x["status"] == "OK")
        assert s["prompt_tokens"] == served_prompt
    by = {r["config"]: r["summary"] for r in trace}
    assert set(by["colocated"]["routes"]) == {"colocated"}  # the idle prefill node stays idle
    assert by["colocated"]["rejected"] == 0  # no admission control
    assert by["disagg-nostore"]["node_tokens"]["fetched_store"] == 0
    assert "disaggregated" in by["disagg-nostore"]["routes"]
    # the workload reuses prefixes; one prefill node with a pool that holds the whole run
    # (and a store behind it) finds nearly all of that reuse
    assert trace[0]["ideal_hit_ratio"] > 0.3
    assert by["kvmesh"]["served"] == 10
    assert by["kvmesh"]["cache_hit_ratio"] >= 0.8 * trace[0]["ideal_hit_ratio"]
    # the cache-size sweep's "without the store" is kvmesh with no segments
    from kvmesh.loadtest.eval_cluster import Setup, configs

    args = configs(Setup(kv_memory="8MiB"), store=False)["kvmesh"]["node_args"]
    assert args[args.index("--segment-memory") + 1] == "0"
    args = configs(Setup(kv_memory="8MiB"))["kvmesh"]["node_args"]
    assert args[args.index("--segment-memory") + 1] == "80MiB"
    report = (out / "report.md").read_text()
    for c in ("colocated", "disagg-nostore", "kvmesh"):
        assert f"| {c} |" in report
    assert "Where kvmesh wins and where it loses" in report
    # whole runs side by side (--runs, eval_runs.py): a run's figures are its report's,
    # and the summary takes their median over runs
    import copy

    from kvmesh.loadtest.eval_report import headline
    from kvmesh.loadtest.eval_runs import summarize, write

    hl = {h["config"]: h for h in headline(ev, "trace")}
    text = write([out], tmp_path)
    one = json.loads((tmp_path / "runs.json").read_text())
    assert one["median"]["trace"]["goodput_x"] == hl["kvmesh"]["goodput_x"] > 0
    assert one["median"]["trace"]["tbt_p99_x"] == hl["kvmesh"]["tbt_p99_x"]
    assert one["runs"][0]["accepted_ok_min"] == min(  # (the cache sweep's runs apart)
        r["summary"]["slo_attainment_accepted"]
        for r in ev["runs"]
        if r["config"] == "kvmesh"
        and r["workload"] in ("trace", "shared", "agentic")
        and r["summary"]["slo_attainment_accepted"] is not None
    )
    assert "| median |" in text
    evs = []
    for k in (1, 3, 2):  # kvmesh's goodput x1, x3, x2: the median run is x2
        e = copy.deepcopy(ev)
        for r in e["runs"]:
            if r["config"] == "kvmesh":
                r["summary"]["goodput_rps"] *= k
        evs.append(e)
    three = summarize(evs)
    assert [f["trace"]["goodput_x"] for f in three["runs"]] == pytest.approx(
        [k * hl["kvmesh"]["goodput_x"] for k in (1, 3, 2)], rel=0.02
    )
    assert three["median"]["trace"]["goodput_x"] == pytest.approx(
        2 * hl["kvmesh"]["goodput_x"], rel=0.02
    )
    assert (out / "eval_goodput_vs_load.png").stat().st_size > 0
