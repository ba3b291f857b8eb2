"""The simulator calibrated to the Mooncake paper's prefill-scheduling experiment
(loadtest/sim/paper.py): the calibrated setup reproduces the paper's ranking and its four
mean TTFTs within 25%, deterministically, in seconds; on the same model, the real
scheduler's prediction-based early rejection refuses fewer requests than plain early
rejection, as in the paper."""

from __future__ import annotations

import pytest

from kvmesh.loadtest.sim.paper import (
    MARK_BEGIN,
    MARK_END,
    PAPER_POLICIES,
    PAPER_TTFT_S,
    PaperConfig,
    calibrated_config,
    early_rejection,
    paper_table,
    simulate_paper,
    splice,
    split_blocks,
)
from kvmesh.loadtest.workload import load_trace


@pytest.fixture(scope="module")
def trace():
    return load_trace()


def test_calibrated_config_reproduces_paper_ranking_and_is_deterministic(trace):
    a = paper_table(trace)
    b = paper_table(trace)
    assert a == b  # deterministic, random policy included (seeded)
    means = [a[p]["ttft_mean_s"] for p in PAPER_POLICIES]
    # random > load-balancing > local cache-aware > global cache-aware, as in the paper
    assert means == sorted(means, reverse=True)
    assert len(set(means)) == 4
    for p in PAPER_POLICIES:
        assert a[p]["requests"] == len(trace)
        assert abs(a[p]["ttft_mean_s"] / PAPER_TTFT_S[p] - 1) <= 0.25, (p, a[p])
    # the cache-aware policies are the ones that hit the prefix cache
    assert a["local"]["hit_ratio"] > 2 * a["load"]["hit_ratio"]
    assert a["global"]["transferred_share"] > 0 == a["local"]["transferred_share"]


def test_prediction_refuses_at_most_0_9x_what_plain_early_rejection_does(trace):
    """The report's early-rejection experiment, whole (a few seconds): ``kvmesh`` (the
    load predicted at the prefill's end) refuses at most 0.9x as many requests as
    ``cache-load`` (the load now; the paper: 0.86x), keeping at least as many inside the
    SLOs. It was 1.16x (549 against 470-473) while a near-SLO error tail stuck at 2.8x
    refused the requests that would have renewed it, and with that mended 0.91x (425
    against 466) while the simulation taught the prefill model its store fetches as
    compute."""
    er = early_rejection(trace)
    plain, predicted = er["policies"]["cache-load"], er["policies"]["kvmesh"]
    assert plain["rejected"] > 200  # (a load at which early rejection matters)
    assert predicted["rejected"] <= 0.9 * plain["rejected"], er["policies"]
    assert predicted["slo_attainment"] >= plain["slo_attainment"], er["policies"]
    assert predicted["served"] + predicted["rejected"] == len(trace)


def test_random_policy_depends_on_seed_only(trace):
    tr = split_blocks(trace[:400], 256)
    r0 = simulate_paper(tr, calibrated_config("random", seed=0)).ttft_ms
    assert simulate_paper(tr, calibrated_config("random", seed=0)).ttft_ms == r0
    assert simulate_paper(tr, calibrated_config("random", seed=1)).ttft_ms != r0


def test_split_blocks_keeps_prefix_sharing():
    recs = [
        {"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [7, 8, 9]},
        {"timestamp": 1, "input_length": 700, "output_length": 1, "hash_ids": [7, 5]},
    ]
    a, b = split_blocks(recs, 256)
    assert len(a["hash_ids"]) == 5  # ceil(1100 / 256)
    assert len(b["hash_ids"]) == 3
    assert a["hash_ids"][:2] == b["hash_ids"][:2]  # shared first 512-token block
    assert a["hash_ids"][2] != b["hash_ids"][2]
    assert split_blocks(recs, 512) is recs
    with pytest.raises(ValueError, match="must divide"):
        split_blocks(recs, 300)


def test_local_cache_aware_reuses_own_cache_and_global_pulls():
    # two instances; a long shared prefix computed on one, then a burst that queues there
    prefix = list(range(40))
    recs = [{"timestamp": 0, "input_length": 40 * 256, "output_length": 1, "hash_ids": prefix}]
    recs += [
        {
            "timestamp": 5000 + i,  # after the prefix is computed
            "input_length": 60 * 256,
            "output_length": 1,
            "hash_ids": prefix + [1000 + 100 * i + j for j in range(20)],
        }
        for i in range(6)
    ]
    cfg = dict(prefill_nodes=2, block_size=256, cache_blocks=1000)
    loc = simulate_paper(recs, PaperConfig(policy="local", **cfg))
    glo = simulate_paper(recs, PaperConfig(policy="global", **cfg))
    assert loc.transferred_tokens == 0 and glo.transferred_tokens > 0
    assert glo.mean_ttft_s < loc.mean_ttft_s
    assert glo.hit_ratio > loc.hit_ratio
    with pytest.raises(ValueError, match="not one of"):
        simulate_paper(recs, PaperConfig(policy="kvmesh"))


def test_splice_replaces_its_section_only(tmp_path):
    rep = tmp_path / "report.md"
    rep.write_text("# r\n\nintro\n\n## Caveats\n\n- x\n")
    splice(rep, f"{MARK_BEGIN}\nv1\n{MARK_END}")
    splice(rep, f"{MARK_BEGIN}\nv2\n{MARK_END}")
    text = rep.read_text()
    assert text.count(MARK_BEGIN) == 1 and "v2" in text and "v1" not in text
    assert text.index("v2") < text.index("## Caveats") and "- x" in text
