"""The fetch-versus-recompute decision prices a store fetch by what the store's remote path
really achieved on the node (its reported fetches), not by the transfer engine's raw
bandwidth: each test here fails when the policy reads the wrong source."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common.node_events import EventHub
from kvmesh.services.conductor.cluster import NodeInfo
from kvmesh.services.conductor.estimator import DecodeModel, PrefillModel
from kvmesh.services.conductor.feeds import NodeFeeds
from kvmesh.services.conductor.policy import (
    DISAGG,
    DecodeNodeState,
    PolicyConfig,
    PrefillNodeState,
    Request,
    Scheduler,
)
from kvmesh.services.conductor.store_fetch import StoreFetchModel

BS = 16


def H(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make(engine_bw: float) -> Scheduler:
    """One prefill node (10 + 0.1/token ms), blocks of 1000 B, the store holding 10 blocks."""
    s = Scheduler(
        PolicyConfig(colocate_below_tokens=0, disagg_overhead_ms=0.0),
        clock=lambda: 0.0,
        rng=random.Random(1),
    )
    s.prefill["p0"] = PrefillNodeState(
        "p0", BS, block_nbytes=1000, layer_nbytes=100, model=PrefillModel(10, 0.1, 0)
    )
    s.prefill["p0"].bandwidth = engine_bw
    s.decode["d0"] = DecodeNodeState(
        "d0", BS, 100, 100, model=DecodeModel(5, 1, 0), prefill_model=PrefillModel(10, 0.1, 0)
    )
    s.index.store_stored([H(i) for i in range(10)])
    return s


def req(n: int) -> Request:
    return Request("r", n, [H(i) for i in range(n // BS)], 16, 1000.0, 100.0)


def test_model_fits_fixed_cost_and_bandwidth():
    m = StoreFetchModel()
    assert m.predict_ms(5000, 1000.0) == pytest.approx(5.0)  # nothing seen: the fallback
    for nbytes in (1000, 4000, 16000, 64000):
        m.observe(nbytes, 2.0 + nbytes / 500.0)
    assert m.fixed_ms == pytest.approx(2.0) and m.bytes_per_ms == pytest.approx(500.0)
    assert m.predict_ms(10000, 1e9) == pytest.approx(22.0)  # the fallback is ignored now


def test_model_one_size_is_plain_throughput_and_bad_samples_are_dropped():
    m = StoreFetchModel()
    m.observe(0, 5.0)
    m.observe(1000, 0.0)
    m.observe(1000, -1.0)
    assert m.observations == 0
    m.observe(4000, 8.0)
    m.observe(4000, 12.0)
    assert m.fixed_ms == 0.0 and m.bytes_per_ms == pytest.approx(400.0)


def test_slow_store_path_recomputes_even_on_a_fast_engine():
    """Engine 1000 B/ms: 9 blocks would cost 9 ms against 14.4 ms saved (fetch). The node's
    store fetches ran at 100 B/ms: 90 ms, so the node recomputes."""
    s = make(engine_bw=1000.0)
    assert s.decide(req(160)).estimate.fetch_blocks == 9  # nothing measured: the engine
    for k in (1, 4, 9):
        s.prefill["p0"].store_fetch.observe(k * 1000, k * 10.0)
    d = s.decide(req(160))
    assert d.route == DISAGG and d.estimate.fetch_blocks == 0
    assert d.estimate.fetch_ms == 0.0


def test_fast_store_path_fetches_on_a_slow_engine_and_prices_it_as_measured():
    """Engine 100 B/ms (would recompute); the store path measured 1 ms + 1000 B/ms: fetch,
    predicted at 1 + 9 = 10 ms. The handoff still goes over the engine."""
    s = make(engine_bw=100.0)
    assert s.decide(req(160)).estimate.fetch_blocks == 0
    for k in (1, 4, 9):
        s.prefill["p0"].store_fetch.observe(k * 1000, 1.0 + k)
    d = s.decide(req(160))
    assert d.estimate.fetch_blocks == 9
    assert d.estimate.speed == 1.0  # nothing measured: the fitted model's own speed
    assert d.estimate.fetch_ms == pytest.approx(10.0)
    # prefix 9 blocks * 1000 B at the engine's 100 B/ms = 90 ms outlasts the 11.6 ms
    # compute; + 1 new block's layer (100 B) at 100 B/ms
    assert d.estimate.handoff_ms == pytest.approx(90.0 - 11.6 + 1.0)


def test_node_reports_its_fetches_and_the_conductor_learns_them():
    """EventHub -> NodeLoad.store_fetches -> NodeFeeds -> the node state's fetch model."""

    class Pool:
        num_free = num_blocks = 1

        def drain_events(self):
            return []

        class prefix_cache:  # noqa: N801
            @staticmethod
            def hashes():
                return []

    async def go() -> pb.NodeEvent:
        hub = EventHub(Pool(), lambda: {"bandwidth": {"peer": 5e9}})
        stream = hub.stream(0.01)
        await stream.__anext__()  # the snapshot; the subscriber exists now
        hub.record_store_fetch(4000, 2.0)
        hub.record_store_fetch(16000, 5.0)
        ev = await stream.__anext__()
        await stream.aclose()
        return ev

    ev = asyncio.run(go())
    assert [(f.bytes, f.ms) for f in ev.load.store_fetches] == [(4000, 2.0), (16000, 5.0)]
    s = make(engine_bw=1000.0)

    async def apply() -> None:
        feeds = NodeFeeds(view=None, sched=s)  # type: ignore[arg-type]
        feeds._apply(NodeInfo("p0", "prefill", "127.0.0.1:1", {}), ev)

    asyncio.run(apply())
    p = s.prefill["p0"]
    assert p.bandwidth == pytest.approx(5e6)  # the engine's, for the handoff
    assert p.store_fetch.observations == 2
    assert p.store_fetch.bytes_per_ms == pytest.approx(4000.0)  # 12000 B more in 3 ms more
    assert p.store_fetch.fixed_ms == pytest.approx(1.0)
