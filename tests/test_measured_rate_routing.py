"""A node's measured rate must not outweigh a cached prefix on the strength of one cold
or noisy prefill (issue 15's routing regression: after one cold request the prefix
holder looked several times slower than its unmeasured peer, and a repeat of the prompt
was recomputed there in full). Fake clock, fixed models, two prefill nodes, no cluster:
each test fails on the old rule (the median of whatever was seen, from the first
prefill on), and the last one fails on a rule that would ignore the rate altogether."""

from __future__ import annotations

import pytest

from kvmesh.services.conductor.estimator import DecodeModel, MeasuredRate, PrefillModel
from kvmesh.services.conductor.policy import (
    DISAGG,
    DecodeNodeState,
    PolicyConfig,
    PrefillNodeState,
    Request,
    Scheduler,
)

BS = 16
N = 800  # a prompt of 50 blocks: 49 usable (the last token is always computed)
SHARED = 40  # blocks a repeat shares with the first prompt
FULL = 10 + 0.1 * N  # PrefillModel(10, 0.1, 0): 90 ms from scratch
CACHED = 10 + 0.1 * (N - SHARED * BS)  # 26 ms after the 640 cached tokens


def make() -> Scheduler:
    now = {"t": 0.0}
    s = Scheduler(
        PolicyConfig(policy="kvmesh", colocate_below_tokens=0, disagg_overhead_ms=0.0),
        clock=lambda: now["t"],
    )
    s.now = now
    for nid in ("p0", "p1"):  # two equal nodes; the prefix goes to the decode node in ~0 ms
        s.prefill[nid] = PrefillNodeState(nid, BS, 1, 0, PrefillModel(10, 0.1, 0), 1000.0)
    s.decode["d0"] = DecodeNodeState(
        "d0", BS, 10_000, 10_000, DecodeModel(5, 1, 0), PrefillModel(10, 0.1, 0)
    )
    return s


def prompt(tag: int) -> list[bytes]:
    """The block hashes of a prompt: the shared prefix, then blocks of its own."""
    return [bytes([i]) * 16 for i in range(SHARED)] + [
        bytes([tag, i]) * 8 for i in range(N // BS - SHARED)
    ]


def serve(s: Scheduler, rid: str, tag: int, slowdown: float) -> str:
    """Decides, books and completes one request whose slot time on the node is
    ``slowdown`` times its model's prediction; the node chosen (its blocks then enter
    the cache index, as its cache events would)."""
    r = Request(rid, N, prompt(tag), 4, 10_000.0, 1000.0)
    d = s.decide(r)
    assert d.accepted and d.route == DISAGG, d.message
    s.commit(r, d)
    c = d.estimate
    assert c is not None
    s.now["t"] += c.work_ms * slowdown
    s.prefill_done(
        r, d, N - c.cached_blocks * BS, c.cached_blocks * BS, node_ms=c.work_ms * slowdown
    )
    s.request_done(r, d, 4)
    assert d.prefill_node is not None
    s.index.stored(d.prefill_node, prompt(tag))
    return d.prefill_node


def repeat(s: Scheduler):
    d = s.decide(Request("again", N, prompt(99), 4, 10_000.0, 1000.0))
    assert d.accepted and d.estimate is not None
    return d


def test_a_cold_first_prefill_does_not_send_a_cached_prefix_elsewhere():
    s = make()
    holder = serve(s, "cold", 1, slowdown=4.0)  # the node's first prefill: warm-up costs
    d = repeat(s)
    # at 4x, the 26 ms left after the cache would count as 104 against the peer's 90
    assert d.prefill_node == holder
    assert d.estimate.cached_blocks == SHARED
    assert d.estimate.ttft_ms == pytest.approx(CACHED)


def test_one_slow_prefill_after_the_warm_up_is_trusted_in_part():
    s = make()
    holder = serve(s, "cold", 1, slowdown=1.0)
    serve(s, "noisy", 2, slowdown=4.0)  # the holder again (it has the prefix): slow once
    p = s.prefill[holder]
    assert p.rate.factor(p.model) == pytest.approx(4.0 ** (1 / p.rate.least))
    d = repeat(s)
    assert d.prefill_node == holder and d.estimate.cached_blocks == SHARED


def test_the_factor_grows_to_the_measured_rate_as_prefills_are_counted():
    rate, model = MeasuredRate(window=20, warmup=1, least=4), PrefillModel(10, 0.1, 0)
    rate.observe(N, 0, 0.0, 10 * FULL)  # warm-up: not counted
    assert rate.factor(model) == 1.0 and rate.observations == 1
    got = []
    for _ in range(5):
        rate.observe(N, 0, 0.0, 2 * FULL)
        got.append(rate.factor(model))
    assert got == pytest.approx([2**0.25, 2**0.5, 2**0.75, 2.0, 2.0])
    assert rate.tokens_per_s == pytest.approx(N / (2 * FULL) * 1000)  # warm-up left out
    # faster than its model: believed at once (no warm-up cost looks fast)
    fast = MeasuredRate(window=20, warmup=1, least=4)
    fast.observe(N, 0, 0.0, 10 * FULL)
    fast.observe(N, 0, 0.0, 0.5 * FULL)
    assert fast.factor(model) == pytest.approx(0.5)


def test_a_node_slow_over_several_prefills_loses_the_prefix_to_recompute():
    """Not blind to the rate: a holder really 4x slower than its model, measured over
    enough prefills, costs more with the cache (104 ms) than its peer from scratch."""
    s = make()
    holder = serve(s, "cold", 1, slowdown=4.0)
    p = s.prefill[holder]
    for i in range(p.rate.least):
        assert serve(s, f"slow{i}", 1, slowdown=4.0) == holder  # its own prefix, still
    assert p.rate.factor(p.model) == pytest.approx(4.0)
    d = repeat(s)
    assert d.prefill_node != holder and d.estimate.cached_blocks == 0
    assert d.estimate.ttft_ms == pytest.approx(FULL)


def test_a_rate_that_could_never_count_enough_prefills_is_refused() -> None:
    with pytest.raises(ValueError, match="least"):
        MeasuredRate(window=3, least=4)
