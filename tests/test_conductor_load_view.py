"""Two conductors share the nodes (issue 17, part 3): each counts the other's admitted
work through the nodes' load reports (queue_depth + running, KV used) and never counts
its own twice. Logic only: fake reports, fixed time models."""

from __future__ import annotations

import asyncio
import random

from kvmesh.protos import kvmesh_pb2 as pb
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

BS = 16


def make() -> Scheduler:
    s = Scheduler(
        PolicyConfig(colocate_below_tokens=0, disagg_overhead_ms=0.0),
        clock=lambda: 0.0,
        rng=random.Random(1),
    )
    for name in ("p0", "p1"):
        s.prefill[name] = PrefillNodeState(
            name, BS, 1000, 100, model=PrefillModel(10, 0.1, 0), bandwidth=1000.0
        )
    for name in ("d0", "d1"):
        s.decode[name] = DecodeNodeState(
            name, BS, 100, 100, model=DecodeModel(5, 1, 0), prefill_model=PrefillModel(10, 0.1, 0)
        )
    return s


def req(rid: str, n: int = 160) -> Request:
    return Request(rid, n, [bytes([i]) * 16 for i in range(n // BS)], 16, 10_000.0, 100.0)


def test_prefill_counts_other_conductors_requests_once():
    p = PrefillNodeState("p", BS, 1000, 100)
    p.enqueue("a", 30.0)
    p.enqueue("b", 30.0)
    # the node holds our two and three of another conductor's
    p.report_queue(5, 40.0)
    assert p.foreign == 3 and p.foreign_ms == 120.0
    assert p.queue_ms == 60.0 + 120.0
    # a report counting only our own (or fewer: one not arrived yet) adds nothing
    p.report_queue(2, 40.0)
    assert p.foreign == 0 and p.queue_ms == 60.0
    p.report_queue(1, 40.0)
    assert p.foreign == 0 and p.queue_ms == 60.0
    # ours leave; the foreign share stays until the next report replaces it
    p.report_queue(4, 40.0)
    p.dequeue("a")
    p.dequeue("b")
    assert p.queue_ms == 80.0 and p.remaining(0.0) == 80.0
    p.report_queue(0, 40.0)
    assert p.queue_ms == 0.0 and p.remaining(0.0) == 0.0


def test_decode_counts_other_conductors_requests_and_kv_once():
    d = DecodeNodeState("d", BS, 100, 100)
    d.admit("a", 1000.0, 64, 4)
    d.report(90, 100)  # the node counts our 4 blocks and 6 of another conductor's
    d.report_queue(3, 10 * BS)
    assert d.foreign == 2 and d.foreign_kv == 10 * BS - 64
    d.report_queue(1, 4 * BS)  # only ours
    assert d.foreign == 0 and d.foreign_kv == 0


def test_scheduler_routes_around_a_node_another_conductor_filled():
    s = make()
    first = s.decide(req("x"))
    assert first.accepted and first.route == DISAGG
    busy = first.prefill_node
    other = "p1" if busy == "p0" else "p0"
    # before any report, a second request would go to the same node as the first
    assert s.decide(req("y")).prefill_node == busy
    # the node reports 8 requests queued there: another conductor's
    s.prefill[busy].report_queue(8, 500.0)
    d = s.decide(req("y"))
    assert d.prefill_node == other
    assert d.estimate is not None and d.estimate.queue_ms == 0.0


def test_decode_choice_sees_other_conductors_batch():
    s = make()
    base = s.decide(req("x"))
    chosen = base.decode_node
    other = "d1" if chosen == "d0" else "d0"
    s.decode[chosen].report_queue(60, 40 * BS)  # another conductor's 60 requests decode there
    assert s.decide(req("y")).decode_node == other


def test_feeds_apply_reports_foreign_work():
    """The event stream's load reports reach the node states through NodeFeeds."""
    s = make()

    async def go() -> None:
        feeds = NodeFeeds(view=None, sched=s)  # type: ignore[arg-type]
        prefill = NodeInfo("p0", "prefill", "127.0.0.1:1", {})
        decode = NodeInfo("d0", "decode", "127.0.0.1:2", {})
        s.prefill["p0"].enqueue("ours", 25.0)
        ev = pb.NodeEvent(
            load=pb.NodeLoad(
                queue_depth=3,
                running=1,
                prefill_samples=[pb.PrefillSample(new_tokens=100, cached_tokens=0, ms=50.0)],
            )
        )
        feeds._apply(prefill, ev)
        p = s.prefill["p0"]
        assert p.foreign == 3 and p.foreign_ms == 150.0 and p.queue_ms == 175.0
        s.decode["d0"].admit("ours", 1000.0, 32, 2)
        feeds._apply(
            decode,
            pb.NodeEvent(
                load=pb.NodeLoad(queue_depth=1, running=2, kv_blocks_free=90, kv_blocks_total=100)
            ),
        )
        d = s.decode["d0"]
        assert d.foreign == 2 and d.foreign_kv == 10 * BS - 32 and d.free_blocks() == 90

    asyncio.run(go())
