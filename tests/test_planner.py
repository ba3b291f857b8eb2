"""The P:D ratio planner (``kvmesh.services.planner``, ``kvmesh plan``): its pick on
synthetic costs where the right split is known, capacities checked against hand-computed
numbers, monotonicity, workload statistics of tiny traces with known reuse, and the
command as a real subprocess."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.loadtest import workload as W
from kvmesh.services.planner import NodeCosts, WorkloadStats, decode_pool, plan, prefill_pool
from kvmesh.services.planner.model import colocated_pool, ttft_miss

ROOT = Path(__file__).resolve().parent.parent
LOOSE_TTFT = 1e5  # s: no queueing margin worth the name


def _costs(**kw) -> NodeCosts:
    """1 ms per prompt token, decode step 10 ms + 1 ms per sequence, free transfers."""
    base = dict(
        model="synthetic",
        dtype="float32",
        block_size=16,
        cpus=1.0,
        prefill_fixed_s=0.0,
        prefill_s_per_token=1e-3,
        prefill_s_per_token_ctx=0.0,
        decode_step_s=0.010,
        decode_step_s_per_seq=0.001,
        decode_step_s_per_ctx_token=0.0,
        kv_bytes_per_token=1024,
        transfer_bytes_per_s=1e12,
        pool_tokens=10_000_000,
        transfer_on_cpu=False,
    )
    base.update(kw)
    return NodeCosts(**base)


def _items(n_in: int, n_out: int, count: int = 50, shared: int = 0):
    return WorkloadStats.from_items([(n_in, n_out, shared)] * count)


# -- capacities against hand-computed numbers --------------------------------------------------
def test_prefill_capacity_is_nodes_over_service_time_without_a_queueing_margin():
    """S = 1000 tokens x 1 ms = 1 s; a TTFT SLO of 1e5 s lets rho reach its 0.999 cap."""
    stats = _items(1000, 10)
    for p in (1, 2, 3):
        got = prefill_pool(_costs(), stats, p, LOOSE_TTFT)
        assert got.service_s == pytest.approx(1.0)
        assert got.capacity_rps == pytest.approx(0.999 * p, rel=1e-6)


def test_prefill_capacity_leaves_a_margin_for_a_tight_ttft():
    """S = 1 s, SLO 2 s, equal requests (cs2 = 0), Poisson (ca2 = 1): the miss share is
    rho * exp(-(2 - 1) * 2 * (1 - rho) / 1); at 10% that is rho ~ 0.36."""
    got = prefill_pool(_costs(), _items(1000, 10), 1, 2.0)
    rho = got.capacity_rps
    assert rho == pytest.approx(0.3598, abs=1e-3)
    assert ttft_miss([1.0], rho, 1.0, 2.0) == pytest.approx(0.1, abs=1e-3)
    # a prompt that alone takes longer than the SLO can never meet it
    assert prefill_pool(_costs(), _items(3000, 10), 2, 2.0).capacity_rps == 0.0


def test_decode_capacity_is_the_batch_the_tbt_allows():
    """TBT 50 ms = 10 ms + 1 ms x B: B = 40 sequences, 40 / (100 tokens x 50 ms) = 8 r/s
    per node; KV of 20 sequences only: B = 20, 20 / (100 x 30 ms) = 6.67 r/s."""
    stats = _items(100, 100)
    got = decode_pool(_costs(), stats, 1, 0.050)
    assert got.capacity_rps == pytest.approx(8.0, rel=1e-3)
    assert got.batch == pytest.approx(40.0, rel=1e-3)
    assert got.limit == "tbt"
    assert decode_pool(_costs(), stats, 3, 0.050).capacity_rps == pytest.approx(24.0, rel=1e-3)
    # a sequence holds 100 + 100 tokens of KV at most: a pool of 4000 holds 20 of them
    small = _costs(pool_tokens=20 * 200)
    got = decode_pool(small, stats, 1, 0.050)
    assert got.limit == "kv"
    assert got.capacity_rps == pytest.approx(20 / (100 * 0.030), rel=1e-3)
    # context tokens cost attention time: c x ctx per sequence joins b
    ctx = _costs(decode_step_s_per_ctx_token=1e-5)  # ctx = 100 + 100 / 2 = 150: +1.5 ms/seq
    b = (0.050 - 0.010) / 0.0025
    assert decode_pool(ctx, stats, 1, 0.050).capacity_rps == pytest.approx(
        b / (100 * 0.050), rel=1e-3
    )


def test_transfers_on_the_cpu_count_as_busy_time():
    """With TCP transfers, a prefill node also sends each request's KV, and a decode node
    receives it: both pools serve less than with RDMA."""
    stats = _items(1000, 100)
    rdma = _costs(transfer_bytes_per_s=1024 * 1000 / 0.5)  # 0.5 s per request's KV
    tcp = dataclasses.replace(rdma, transfer_on_cpu=True)
    assert prefill_pool(tcp, stats, 1, LOOSE_TTFT).service_s == pytest.approx(1.5)
    assert prefill_pool(rdma, stats, 1, LOOSE_TTFT).service_s == pytest.approx(1.0)
    assert (
        decode_pool(tcp, stats, 1, 0.05).capacity_rps
        < decode_pool(rdma, stats, 1, 0.05).capacity_rps
    )


# -- the pick ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n_in, n_out, want",
    [
        (1000, 10, (3, 1)),  # prefill 1 r/s per node, decode 80: prefill-heavy
        (10, 1000, (1, 3)),  # prefill 100 r/s per node, decode 0.8: decode-heavy
        (500, 400, (2, 2)),  # prefill 2 r/s per node, decode 2: balanced
    ],
)
def test_the_pick_gives_the_pool_that_saturates_first_more_nodes(n_in, n_out, want):
    p = plan(_costs(), _items(n_in, n_out), 4, 1.0, LOOSE_TTFT, 0.050)
    assert p.pick == want
    assert p.best.capacity_rps == max(r.capacity_rps for r in p.ratios)
    assert [r.label for r in p.ratios] == ["1P:3D", "2P:2D", "3P:1D"]
    by_p = {r.prefill_nodes: r for r in p.ratios}
    if want == (3, 1):
        assert by_p[3].capacity_rps == pytest.approx(2.997, rel=1e-3)
        assert all(r.bottleneck == "prefill" for r in p.ratios)
    if want == (1, 3):
        assert by_p[1].capacity_rps == pytest.approx(2.4, rel=1e-3)
        assert all(r.bottleneck == "decode" for r in p.ratios)
    if want == (2, 2):
        assert by_p[2].capacity_rps == pytest.approx(2 * 1.998, rel=1e-3)
        assert by_p[1].bottleneck == "prefill" and by_p[3].bottleneck == "decode"


def test_the_pick_scales_with_the_nodes_and_follows_the_costs():
    stats = _items(1000, 100)
    # 6 nodes: prefill 1 r/s per node, decode 40 / (100 x 50 ms) = 8 r/s: 5P:1D
    p = plan(_costs(), stats, 6, 1.0, LOOSE_TTFT, 0.050)
    assert p.pick == (5, 1)
    assert p.best.capacity_rps == pytest.approx(5 * 0.999, rel=1e-6)
    # decode steps 4x as costly: B = (50 - 40) / 4 = 2.5, 2.5 / (100 x 50 ms) = 0.5 r/s
    # per decode node: 2P:4D (min(1.998, 2)) beats 3P:3D (min(2.997, 1.5))
    slow = _costs(decode_step_s=0.040, decode_step_s_per_seq=0.004)
    assert plan(slow, stats, 6, 1.0, LOOSE_TTFT, 0.050).pick == (2, 4)


def test_costs_measured_at_one_budget_are_rescaled_to_the_planned_one():
    """Costs at 1 core planned at 0.5: every time doubles, so each capacity halves."""
    stats = _items(1000, 10)
    one = plan(_costs(), stats, 4, 1.0, LOOSE_TTFT, 0.2)
    half = plan(_costs(), stats, 4, 0.5, LOOSE_TTFT, 0.2)
    assert half.costs.prefill_s_per_token == pytest.approx(2e-3)
    for a, b in zip(one.ratios, half.ratios):
        assert b.prefill.capacity_rps == pytest.approx(a.prefill.capacity_rps / 2, rel=1e-6)


# -- monotonicity ------------------------------------------------------------------------------
def _trace_stats(**kw) -> WorkloadStats:
    recs = W.sample_groups(W.load_trace(), 0.015, 3)
    kw = {"block_tokens": 16, "max_input": 1536, "max_output": 32, "output_scale": 1 / 12} | kw
    kw = {"local_cache_tokens": 4096} | kw
    return WorkloadStats.from_records(recs, **kw)


def _real_costs() -> NodeCosts:
    """Costs of the shape measured for the medium model at 0.375 cores."""
    return _costs(
        cpus=0.375,
        prefill_fixed_s=0.002,
        prefill_s_per_token=1e-3,
        prefill_s_per_token_ctx=2e-7,
        decode_step_s=0.006,
        decode_step_s_per_seq=0.0012,
        decode_step_s_per_ctx_token=2.9e-5,
        kv_bytes_per_token=6144,
        transfer_bytes_per_s=4.7e8,
        pool_tokens=4096,
        transfer_on_cpu=True,
    )


def test_capacities_are_monotonic():
    costs, stats = _real_costs(), _trace_stats()
    pre = [prefill_pool(costs, stats, p, 2.0).capacity_rps for p in range(1, 6)]
    dec = [decode_pool(costs, stats, d, 0.15).capacity_rps for d in range(1, 6)]
    assert all(b > a for a, b in zip(pre, pre[1:])) and pre[0] > 0
    assert all(b > a for a, b in zip(dec, dec[1:])) and dec[0] > 0
    # looser SLOs never lose capacity; tighter ones never gain
    ttfts = [prefill_pool(costs, stats, 2, s).capacity_rps for s in (1.0, 2.0, 4.0, 8.0)]
    assert all(b > a for a, b in zip(ttfts, ttfts[1:]))
    tbts = [decode_pool(costs, stats, 2, s) for s in (0.05, 0.1, 0.15, 0.3)]
    assert tbts[0].capacity_rps < tbts[1].capacity_rps < tbts[2].capacity_rps
    # until the KV pool caps the batch (4096 tokens, ~290 a sequence): no gain beyond
    assert tbts[3].limit == "kv" and tbts[3].capacity_rps == tbts[2].capacity_rps
    assert tbts[3].batch == pytest.approx(4096 / stats.decode_kv_mean)
    # more cores per node: more capacity, every split and colocated
    plans = [plan(costs, stats, 4, f, 2.0, 0.15) for f in (0.25, 0.375, 0.75)]
    for lo, hi in zip(plans, plans[1:]):
        for a, b in zip(lo.ratios, hi.ratios):
            assert b.capacity_rps > a.capacity_rps
        assert hi.colocated.capacity_rps > lo.colocated.capacity_rps
    # a shared prefix served from the store: more prefill capacity the longer it is
    shared = [
        prefill_pool(costs, _items(1024, 16, 100, s), 2, 2.0).capacity_rps
        for s in (0, 256, 512, 960)
    ]
    assert all(b > a for a, b in zip(shared, shared[1:]))


def test_longer_outputs_move_the_pick_towards_decode():
    costs = _real_costs()
    picks = [
        plan(costs, _items(256, out, 200, 128), 6, 0.375, 2.0, 0.15).pick[1] for out in (4, 64, 512)
    ]
    assert picks == sorted(picks) and picks[-1] > picks[0]


def test_colocated_nodes_share_their_time_between_prefill_and_decode():
    """No reuse, free transfers, a prefill-heavy workload: 4 colocated nodes all prefill,
    so they beat 3P:1D, yet each gives a share of its time to decode steps (a step is
    11 ms beside a 127-token chunk of 127 ms): below 4 nodes' pure prefill."""
    stats = _items(1000, 10)
    p = plan(_costs(), stats, 4, 1.0, LOOSE_TTFT, 0.2)
    co = p.colocated.capacity_rps
    assert p.best.capacity_rps < co < 4 * 0.999 * 127 / 138
    assert co > 4 * 0.999 * 0.9
    # a TBT SLO the prefill chunks stretch the steps past: gap = 11 ms / (1 - rho) <= 50 ms
    tight = colocated_pool(_costs(), stats, 4, LOOSE_TTFT, 0.05)
    assert tight.limit == "tbt" and tight.capacity_rps == pytest.approx(4 * 0.78, rel=0.02)
    # caches that only the store shares: smaller local ones lose colocated capacity
    costs = _real_costs()
    small, big = _trace_stats(local_cache_tokens=1024), _trace_stats(local_cache_tokens=None)
    assert small.reuse_at(4, shared_store=False) < big.reuse_at(4, shared_store=False)
    assert (
        colocated_pool(costs, small, 4, 2.0, 0.15).capacity_rps
        < colocated_pool(costs, big, 4, 2.0, 0.15).capacity_rps
    )


# -- workload statistics -----------------------------------------------------------------------
def _write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


TINY = [  # at 16 tokens per hash id: 64, 64, 64 and 32 tokens
    {"timestamp": 0, "input_length": 2048, "output_length": 320, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 10, "input_length": 2048, "output_length": 160, "hash_ids": [1, 2, 5, 6]},
    {"timestamp": 20, "input_length": 2048, "output_length": 320, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 30, "input_length": 1024, "output_length": 32, "hash_ids": [7, 8]},
]


def test_trace_stats_count_whole_leading_blocks_and_split_caches(tmp_path):
    """Hits: 0, 32 (ids 1, 2), 48 (ids 1-3: the last token is always computed), 0 of 224.
    Over 2 nodes: the second request goes to the idle node (64 tokens of work there,
    against 64 + 32 where its prefix is), the third where ids 1-3 are: 48 of 224."""
    path = _write_trace(tmp_path / "tiny.jsonl", TINY)
    s = WorkloadStats.from_trace(path, block_tokens=16, max_output=8)
    assert s.requests == 4 and s.input_mean == 224 / 4
    assert s.output_mean == (8 + 5 + 8 + 1) / 4  # outputs x 1/32, capped at 8
    assert s.reuse == pytest.approx(80 / 224)
    assert s.reuse_by_nodes[0] == pytest.approx(80 / 224)
    assert s.reuse_by_nodes[1] == pytest.approx(48 / 224)
    assert [r.hits_shared for r in s.samples] == [0, 32, 48, 0]
    # a cache of 4 blocks: the second request's blocks push id 3 out
    small = WorkloadStats.from_trace(path, block_tokens=16, local_cache_tokens=64)
    assert small.reuse_by_nodes[0] == pytest.approx(64 / 224)
    assert small.reuse == pytest.approx(80 / 224)  # the store: unbounded
    # the store bounded too
    both = WorkloadStats.from_trace(path, block_tokens=16, shared_cache_tokens=64)
    assert both.reuse == pytest.approx(64 / 224)
    # a cap on input cuts the tail, the prefix stays shared (as trace_items does)
    capped = WorkloadStats.from_trace(path, block_tokens=16, max_input=40)
    assert capped.input_mean == 152 / 4 and capped.reuse == pytest.approx((32 + 32) / 152)


def test_item_stats_know_their_groups():
    """Three requests behind a common 64-token prefix (the first computes it), one alone."""
    s = WorkloadStats.from_items([(100, 10, 64)] * 3 + [(50, 5, 0)])
    assert s.reuse == pytest.approx(128 / 350)
    assert s.input_mean == 350 / 4 and s.output_mean == 35 / 4
    assert s.arrival_cv2 == 1.0
    # O-weighted context of a decoding sequence: (3 x 10 x 105 + 5 x 52.5) / 35
    assert s.decode_context_mean == pytest.approx((3 * 10 * 105 + 5 * 52.5) / 35)
    # two groups over two nodes: each group stays on one node
    g = WorkloadStats.from_items([(100, 10, 64, "a"), (100, 10, 64, "b")] * 4)
    assert g.reuse == pytest.approx(6 * 64 / 800)
    assert g.reuse_by_nodes[1] == pytest.approx(6 * 64 / 800)
    with pytest.raises(ValueError):
        WorkloadStats.from_items([(10, 1, 20)])


def test_stats_match_what_the_evaluation_sends():
    """The trace's evaluation sample, scaled as the evaluation scales it: the same token
    counts as its items, and the same reuse as the load generator's ideal hit ratio."""
    scaling = dict(block_tokens_n=16, max_input=1536, max_output=32, output_scale=1 / 12)
    recs = W.sample_groups(W.load_trace(), 0.015, 3)
    items = W.trace_items(recs, seed=1000, **scaling)
    s = WorkloadStats.from_trace(
        W.DEFAULT_TRACE,
        share=0.015,
        sample_seed=3,
        block_tokens=16,
        max_input=1536,
        max_output=32,
        output_scale=1 / 12,
    )
    assert s.requests == len(items)
    assert s.input_mean == pytest.approx(sum(i.n_tokens for i in items) / len(items))
    assert s.output_mean == pytest.approx(sum(i.max_tokens for i in items) / len(items))
    assert s.reuse == pytest.approx(W.ideal_hit_ratio(items, 16), abs=1e-9)
    assert s.reuse > 0.3
    by_tokens = WorkloadStats.from_workload_items(items)
    assert by_tokens.reuse == pytest.approx(s.reuse, abs=1e-9)
    assert by_tokens.reuse_by_nodes == pytest.approx(s.reuse_by_nodes, abs=1e-9)
    shared = W.shared_prefix_items(80, prefixes=4, prefix_tokens=(300, 500))
    st = WorkloadStats.from_workload_items(shared)
    assert st.reuse == pytest.approx(W.ideal_hit_ratio(shared, 16), abs=1e-9)
    assert st.reuse_by_nodes[3] < st.reuse  # 4 nodes without a store recompute more


# -- costs: JSON and measurement ---------------------------------------------------------------
def test_costs_round_trip_and_reject_what_cannot_be_a_node(tmp_path):
    c = _real_costs()
    c.save(tmp_path / "c.json")
    assert NodeCosts.load(tmp_path / "c.json") == c
    d = c.to_dict()
    assert NodeCosts.from_dict({**d, "later_field": 1}) == c
    with pytest.raises(ValueError, match="pool_tokens"):
        NodeCosts.from_dict({k: v for k, v in d.items() if k != "pool_tokens"})
    with pytest.raises(ValueError):
        NodeCosts.from_dict({**d, "decode_step_s_per_seq": -1.0})
    assert c.prefill_seconds(100, 50) == pytest.approx(0.002 + 100 * (1e-3 + 2e-7 * 100))
    assert c.step_seconds(4, 1000) == pytest.approx(0.006 + 4 * 0.0012 + 1000 * 2.9e-5)


def test_measure_costs_with_the_real_engine():
    """The tiny model, in this process: every cost positive, the fit close to the points
    it was fitted on (CPU seconds at half a core: each point's CPU time x 2)."""
    from kvmesh.services.planner.measure import measure_costs

    c = measure_costs("tiny", cpus=0.5, reps=3, kv_memory="1MiB")
    assert c.cpus == 0.5 and c.threads == 1
    assert c.raw["clock"] == "cpu" and c.raw["divisor"] == 0.5
    assert c.kv_bytes_per_token == 4 * 2 * 2 * 16 * 4  # layers, K+V, kv heads, dim, fp32
    assert c.pool_tokens == (1 << 20) // (c.kv_bytes_per_token * 16) * 16
    assert c.transfer_bytes_per_s > 1e6
    assert c.prefill_seconds(512) > c.prefill_seconds(32) > 0
    assert c.step_seconds(16, 16 * 1024) > c.step_seconds(1, 64) > 0
    n, s, t = max(c.raw["prefill_points"], key=lambda p: p[0])
    assert c.prefill_seconds(n, s) == pytest.approx(t, rel=0.5)
    assert NodeCosts.from_dict(json.loads(json.dumps(c.to_dict()))) == c


# -- the command -------------------------------------------------------------------------------
def _kvmesh_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.services.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    "in_len, out_len, want", [(1000, 10, "3P:1D"), (10, 1000, "1P:3D"), (500, 400, "2P:2D")]
)
def test_kvmesh_plan_names_the_ratio(tmp_path, in_len, out_len, want):
    """Synthetic costs (--costs, no measuring) and a trace of equal requests whose right
    split is known (as in the library's pick test): the command names it."""
    _costs().save(tmp_path / "costs.json")
    trace = _write_trace(
        tmp_path / "w.jsonl",
        [
            {"timestamp": i * 100, "input_length": in_len, "output_length": out_len,
             "hash_ids": [10 * i + k for k in range(4)]}
            for i in range(40)
        ],
    )  # fmt: skip
    common = [
        "--workload", str(trace), "--nodes", "4", "--cpus", "1", "--costs",
        str(tmp_path / "costs.json"), "--ttft-slo-ms", str(LOOSE_TTFT * 1e3),
        "--tbt-slo-ms", "50",
    ]  # fmt: skip
    out = _kvmesh_plan(*common)
    assert out.returncode == 0, out.stderr
    assert f"pick: {want}" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line[:1].isdigit() and "P:" in line]
    assert [r.split()[0] for r in rows] == ["1P:3D", "2P:2D", "3P:1D"]
    js = _kvmesh_plan(*common, "--json")
    assert js.returncode == 0, js.stderr
    d = json.loads(js.stdout)
    assert d["pick"]["label"] == want
    assert len(d["ratios"]) == 3 and d["workload"]["requests"] == 40


def test_kvmesh_plan_says_what_is_wrong(tmp_path):
    _costs().save(tmp_path / "costs.json")
    out = _kvmesh_plan("--workload", str(tmp_path / "nope.jsonl"), "--nodes", "4", "--cpus",
                       "1", "--costs", str(tmp_path / "costs.json"))  # fmt: skip
    assert out.returncode == 1 and "nope.jsonl" in out.stderr and "Traceback" not in out.stderr
    out = _kvmesh_plan("--workload", "x", "--nodes", "1", "--cpus", "1")
    assert out.returncode == 2 and "at least 2" in out.stderr


def test_kvmesh_up_splits_nodes_by_a_given_ratio_or_the_planners_pick(tmp_path):
    import argparse

    from kvmesh.services.launcher.up import node_split

    def ns(**kw):
        base = dict(nodes=0, ratio="", workload="", cpus=0.5, block_size=16)
        return argparse.Namespace(**{**base, **kw})

    assert node_split(ns(), "tiny") is None  # --prefill/--decode as before
    assert node_split(ns(nodes=4, ratio="1:3"), "tiny") == (1, 3)
    for bad, why in [
        (ns(ratio="1:1"), "needs --nodes"),
        (ns(nodes=1, ratio="1:0"), "at least 2"),
        (ns(nodes=4, ratio="2:3"), "P \\+ D = --nodes"),
        (ns(nodes=4, ratio="two"), "give P:D"),
        (ns(nodes=4), "needs --workload"),
        (ns(nodes=4, ratio="auto", workload=str(tmp_path / "missing.jsonl")), "missing"),
    ]:
        with pytest.raises(ValueError, match=why):
            node_split(bad, "tiny")
    # auto: long prompts with no reuse and one-token outputs are prefill-bound -> 3P:1D
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {"timestamp": 100 * i, "input_length": 512, "output_length": 1,
                 "hash_ids": [10 * i + k for k in range(32)]}
            ) + "\n"
            for i in range(40)
        )
    )  # fmt: skip
    assert node_split(ns(nodes=4, ratio="auto", workload=str(trace)), "tiny") == (3, 1)
