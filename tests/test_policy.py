"""Admission and routing against hand-computed expectations: fake clock, fake node
reports, fixed time models (no real cluster here; tests/test_routing.py has that)."""

from __future__ import annotations

import random

import pytest

from kvmesh.services.conductor.config import ConductorConfig
from kvmesh.services.conductor.estimator import DecodeModel, PrefillModel
from kvmesh.services.conductor.index import CacheIndex
from kvmesh.services.conductor.policy import (
    COLOCATED,
    DIRECT,
    DISAGG,
    INFEASIBLE,
    SLO_MARGIN,
    DecodeNodeState,
    PolicyConfig,
    PrefillNodeState,
    Request,
    Scheduler,
)

BS = 16


def H(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make(
    policy: str = "kvmesh", colocate: int = 0, overhead: float = 0.0, bandwidth: float = 1000.0
) -> Scheduler:
    now = {"t": 0.0}
    s = Scheduler(
        PolicyConfig(policy=policy, colocate_below_tokens=colocate, disagg_overhead_ms=overhead),
        clock=lambda: now["t"],
        rng=random.Random(1),
    )
    s.now = now
    for name in ("p0", "p1"):
        s.prefill[name] = PrefillNodeState(
            name,
            BS,
            block_nbytes=1000,
            layer_nbytes=100,
            model=PrefillModel(10, 0.1, 0),
            bandwidth=bandwidth,
        )
    s.decode["d0"] = DecodeNodeState(
        "d0", BS, 100, 100, model=DecodeModel(5, 1, 0), prefill_model=PrefillModel(10, 0.1, 0)
    )
    return s


def req(n: int, ttft=1000.0, tbt=100.0, max_tokens=16, rid="r") -> Request:
    return Request(rid, n, [H(i) for i in range(n // BS)], max_tokens, ttft, tbt)


def test_prefers_the_node_holding_the_prefix():
    s = make()
    s.index.stored("p1", [H(i) for i in range(8)])
    d = s.decide(req(160))
    # p1: 8 cached blocks -> 10 + 0.1*32 = 13.2 prefill, handoff 2 blocks * 100/1000 = 0.2
    assert d.accepted and d.route == DISAGG and d.prefill_node == "p1"
    assert d.estimate.ttft_ms == pytest.approx(13.4)
    assert d.estimate.cached_blocks == 8
    assert d.tbt_ms == pytest.approx(6.0)  # 5 + 1 * (batch 0 + 1)
    p0 = next(c for c in d.candidates if c.node == "p0")
    assert p0.ttft_ms == pytest.approx(27.0)  # 10 + 16 + 10 blocks * 0.1


def test_queue_outweighs_cache():
    s = make()
    s.index.stored("p1", [H(i) for i in range(8)])
    s.prefill["p1"].enqueue("other", 20.0)
    d = s.decide(req(160))
    assert d.prefill_node == "p0" and d.estimate.ttft_ms == pytest.approx(27.0)


@pytest.mark.parametrize("bandwidth, fetched, ttft", [(1000.0, 9, 20.7), (100.0, 0, 36.0)])
def test_store_fetch_only_when_it_beats_recompute(bandwidth, fetched, ttft):
    s = make(bandwidth=bandwidth)
    s.index.store_stored([H(i) for i in range(10)])
    d = s.decide(req(160))
    # usable = (160-1)//16 = 9 blocks; fetch 9 * 1000 B at 1000 B/ms = 9 ms saves
    # 26 - (10 + 1.6) = 14.4 ms: worth it. At 100 B/ms it costs 90 ms: recompute (and the
    # handoff of 10 layers-of-blocks costs 10 ms).
    assert d.estimate.fetch_blocks == fetched
    assert d.estimate.ttft_ms == pytest.approx(ttft)


def test_ttft_slo_rejects_with_estimate_and_retry_hint():
    """An SLO an idle node meets (27 ms <= 0.95 x 40) but the queues break: retry later."""
    s = make()
    for p in ("p0", "p1"):
        s.prefill[p].enqueue("busy", 20.0)
    d = s.decide(req(160, ttft=40.0))
    assert not d.accepted and d.reason == "ttft"
    assert "estimated TTFT 47.0 ms" in d.message and "TTFT SLO of 40.0 ms" in d.message
    assert d.retry_after_ms >= 50


def test_a_ttft_slo_below_the_floor_is_infeasible_naming_the_floor():
    """Even idle, the best node needs 27 ms: an SLO of 10 ms can never be met, so no
    retry hint; the message names the floor and the SLO to ask for (27 / 0.95)."""
    s = make()
    for p in ("p0", "p1"):
        s.prefill[p].enqueue("busy", 20.0)  # the queues do not count in the floor
    d = s.decide(req(160, ttft=10.0))
    assert not d.accepted and d.reason == INFEASIBLE and d.retry_after_ms == 0
    assert "TTFT SLO of 10.0 ms is below the floor" in d.message, d.message
    assert "27.0 ms" in d.message and "at least 28.4 ms" in d.message
    assert "retry" not in d.message


def test_a_tbt_slo_below_a_batch_of_one_is_infeasible():
    """A step of a batch of one takes 5 + 1 = 6 ms: a 5 ms TBT SLO can never be met."""
    d = make().decide(req(160, tbt=5.0))
    assert not d.accepted and d.reason == INFEASIBLE
    assert "TBT SLO of 5.0 ms is below the floor" in d.message
    assert "at least 6.3 ms" in d.message, d.message


def test_kv_beyond_the_largest_decode_node_is_infeasible():
    """100 blocks of 16 hold 1600 tokens: 160 + 1600 never fit; a full node is a 429."""
    s = make()
    d = s.decide(req(160, max_tokens=1600))
    assert not d.accepted and d.reason == INFEASIBLE
    assert "KV for 1760 tokens" in d.message and "(1600)" in d.message
    s.decode["d0"].report(free=2, total=100)
    assert s.decide(req(160, max_tokens=64)).reason == "kv"


def test_a_ttft_slo_spent_before_routing_is_reported_as_the_clients_slo():
    """The budget left may be negative (a 0.001 ms SLO, time spent parsing): the message
    names the SLO the client asked for, never "SLO of -0.3 ms"."""
    s = make()
    r = req(160, ttft=0.001 - 0.3)
    r.ttft_spent_ms = 0.3
    d = s.decide(r)
    assert not d.accepted and d.reason == INFEASIBLE
    assert "TTFT SLO of 0.001 ms is below the floor" in d.message, d.message
    assert "-0." not in d.message
    # within reach of an idle node, but queued: the spent time is named
    for p in ("p0", "p1"):
        s.prefill[p].enqueue("busy", 20.0)
    r = req(160, ttft=40.0 - 0.3)
    r.ttft_spent_ms = 0.3
    d = s.decide(r)
    assert not d.accepted and d.reason == "ttft"
    assert "TTFT SLO of 40.0 ms (0.3 ms of it spent in the conductor" in d.message, d.message


def test_slo_margin_has_one_default():
    """The conductor's --slo-margin and the scheduler's own default are the same value:
    a scheduler built from the default service config equals a default one."""
    assert ConductorConfig().policy_config() == PolicyConfig()
    assert PolicyConfig().slo_margin == ConductorConfig().slo_margin == SLO_MARGIN < 1


@pytest.mark.parametrize("margin, accepted", [(1.0, True), (0.85, False)])
def test_slo_margin_leaves_room_for_estimate_error(margin, accepted):
    s = make()
    s.cfg.slo_margin = margin
    d = s.decide(req(160, ttft=30.0))  # estimate 27.0 ms: within 30, not within 0.85 x 30
    # idle nodes: what the margin refuses here, it always will
    assert d.accepted is accepted and d.reason == ("" if accepted else INFEASIBLE)


def test_predicted_decode_load_admits_what_plain_rejection_refuses():
    """Ten requests finish at t=5 ms, before this prefill would end (~27 ms). Judged by the
    load now (plain early rejection) the TBT SLO fails; judged at prefill end it holds."""
    plain, predictive = make("cache-load"), make("kvmesh")
    for s in (plain, predictive):
        for i in range(10):
            s.decode["d0"].admit(f"old{i}", end=5.0, kv=0, blocks=0)
    r = req(160, tbt=8.0)
    assert not plain.decide(r).accepted and plain.decide(r).reason == "tbt"  # 5 + 11 = 16 > 8
    d = predictive.decide(r)
    assert d.accepted and d.tbt_ms == pytest.approx(6.0)


def test_colocated_route_for_short_prompt_when_faster():
    s = make(colocate=512, overhead=2.0)
    s.prefill["p0"].enqueue("x", 50.0)
    s.prefill["p1"].enqueue("y", 50.0)
    d = s.decide(req(100))
    # decode node: step 5 + prefill 10 + 0.1*100 = 25; prefill nodes: 50 + 20 + 0.7 + 2
    assert d.accepted and d.route == COLOCATED and d.decode_node == "d0"
    assert d.prefill_node is None and d.estimate.ttft_ms == pytest.approx(25.0)


def test_decode_direct_when_decode_node_holds_most_of_the_prefix():
    s = make()
    s.index.stored("d0", [H(i) for i in range(18)])
    d = s.decide(req(320))
    # usable 19 blocks, 18 >= 0.9*19 held by d0: 5 + 10 + 0.1*32 = 18.2 < p0's 44
    assert d.route == DIRECT and d.estimate.ttft_ms == pytest.approx(18.2)
    assert d.estimate.cached_blocks == 18


def test_fewer_blocks_held_than_the_index_said_move_the_estimate_and_the_booking():
    s = make()
    s.index.stored("d0", [H(i) for i in range(18)])
    r = req(320, rid="a")
    d = s.decide(r)
    assert d.route == DIRECT and d.estimate.ttft_ms == pytest.approx(18.2)
    s.commit(r, d)
    dn = s.decode["d0"]
    assert dn.local_queue_ms == pytest.approx(13.2)
    assert s.held_locally(r, d, 18) is None  # all there: nothing moves
    assert d.estimate.ttft_ms == pytest.approx(18.2)
    # 10 of the 18 survived: 10 + 0.1 * 160 = 26 ms of compute, not 13.2; still in SLO
    assert s.held_locally(r, d, 10) is None
    assert d.estimate.ttft_ms == pytest.approx(31.0) and d.estimate.cached_blocks == 10
    assert dn.local_queue_ms == pytest.approx(26.0)  # the booking is the new work
    s.request_done(r, d)  # ended before its prompt was computed: nothing stays booked
    assert dn.local_queue_ms == 0.0


def test_a_local_prefix_gone_past_the_slo_is_refused_with_why():
    s = make()
    s.index.stored("d0", [H(i) for i in range(18)])
    r = req(320, ttft=40.0, rid="a")
    d = s.decide(r)
    assert d.route == DIRECT
    s.commit(r, d)
    late = s.held_locally(r, d, 0)  # 10 + 0.1 * 320 = 42 ms of compute: past 40 x 0.95
    assert late is not None
    why, retry = late
    assert "holds 0 of the 18 prefix blocks" in why and "first token at 47 ms" in why
    assert retry == pytest.approx(50.0)  # (47 - 38 = 9: at least 50)
    s.request_done(r, d)
    assert s.decode["d0"].local_queue_ms == 0.0


def test_a_local_booking_leaves_once_whichever_ends_it_first():
    s = make(colocate=512)
    a, b = req(100, rid="a"), req(100, rid="b")
    da, db = s.decide(a), s.decide(b)
    assert da.route == db.route == COLOCATED
    s.commit(a, da)
    s.commit(b, db)
    dn = s.decode["d0"]
    assert dn.local_queue_ms == pytest.approx(40.0)  # 20 each
    s.prefill_done(a, da, 100, 0)
    s.request_done(a, da)  # after prefill_done: not taken off twice
    assert dn.local_queue_ms == pytest.approx(20.0)
    s.request_done(b, db)  # refused by the node before its prompt was computed
    assert dn.local_queue_ms == 0.0


def test_kv_room_is_required():
    s = make()
    s.decode["d0"].report(free=2, total=100)
    d = s.decide(req(160, max_tokens=64))
    assert not d.accepted and d.reason == "kv"


def test_kv_room_counts_the_prefix_a_request_decoding_there_holds():
    """The decode node caches a prompt's blocks once its KV is in place, and a request
    sharing the prefix pins them there: it needs room only for the rest. Before the
    first's prompt is in place, and after it ended, the whole is needed."""
    s = make()
    s.cfg.wait_for_kv = False  # (the rule for room now; waiting for it: below)
    dn = s.decode["d0"]
    a, b, c = (req(320, rid=rid) for rid in "abc")  # 20 prompt blocks, 21 in all
    other = Request("o", 320, [H(100 + i) for i in range(20)], 16, 1000.0, 100.0)
    da = s.decide(a)
    s.commit(a, da)
    dn.report(free=10, total=100)  # (a's blocks counted by the node now)
    assert s.decide(b).reason == "kv"  # a's prompt is still being computed
    s.prefill_done(a, da, 320, 0)
    s.prompt_held(a, da)
    assert s.decide(other).reason == "kv"  # another prefix: nothing to pin
    db = s.decide(b)
    assert db.accepted  # pins 19 blocks of a's ((320 - 1) // 16), takes 2
    s.commit(b, db)
    assert dn.free_blocks() == 8  # booked: the 2 it takes
    s.request_done(a, da)
    dn.report(free=5, total=100)
    assert s.decide(c).reason == "kv"  # a ended; b's prompt is not in place yet
    s.prefill_done(b, db, 320, 0)
    s.prompt_held(b, db)
    assert s.decide(c).accepted
    s.request_done(b, db)
    assert not dn.prompts


def test_a_report_made_before_a_reservation_does_not_free_its_booked_blocks():
    """A decode node numbers its reservations and each load report says how many it had
    made: a booking stays counted against the free blocks through reports made before
    its reservation (its Reserve still on its way, or numbered after the report), and
    leaves them with the first report made after it, or at once when that report came
    before the Reserve's answer. A node that does not number them, or that restarted,
    gets the old rule: every report counts every booking."""
    s = make()
    s.cfg.wait_for_kv = False
    dn = s.decode["d0"]
    dn.report(free=100, total=100, seen=4)
    a, b = req(320, rid="a"), req(320, rid="b")  # 21 blocks each
    da = s.decide(a)
    s.commit(a, da)
    assert dn.free_blocks() == 79
    dn.report(free=100, total=100, seen=4)  # made before a's Reserve reached the node
    assert dn.free_blocks() == 79 and dn.reserved_blocks == 21
    s.reserved(a, da, 5)  # the node's 5th reservation
    dn.report(free=100, total=100, seen=4)  # still made before it
    assert dn.free_blocks() == 79
    dn.report(free=79, total=100, seen=5)  # counts it: not twice
    assert dn.free_blocks() == 79 and dn.reserved_blocks == 0 and not dn.unreported
    db = s.decide(b)
    s.commit(b, db)
    dn.report(free=58, total=100, seen=6)  # counted b before its answer came back
    assert dn.free_blocks() == 58 - 21  # (counted twice until the answer: never too many)
    s.reserved(b, db, 6)
    assert dn.free_blocks() == 58 and not dn.unreported and not dn.reserve_seq
    s.request_done(b, db)
    c = req(320, rid="c")
    dc = s.decide(c)
    s.commit(c, dc)
    s.reserved(c, dc, 7)
    dn.report(free=79, total=100, seen=2)  # the node restarted: its count went back
    assert dn.free_blocks() == 79 and not dn.unreported and not dn.reserve_seq
    d = req(320, rid="d")
    dd = s.decide(d)
    s.commit(d, dd)
    dn.report(free=79, total=100)  # a node that does not number them
    assert dn.free_blocks() == 79 and dn.reports_seen == 0
    s.request_done(d, dd)
    s.request_done(c, dc)
    s.request_done(a, da)
    assert dn.reserved_blocks == 0 and not dn.work and not dn.reserve_seq


def test_a_request_that_waited_for_room_is_counted_until_a_report_made_after_it():
    """A request admitted to wait for KV room is held as waiting (not on the node); once
    the node reserves it, it counts as reserved until a report numbered at or after its
    reservation, or at once no longer when such a report came before the answer."""
    from kvmesh.services.conductor.nodes import DecodeNodeState

    dn = DecodeNodeState("d0", 16, 100, 100)
    dn.report(free=100, total=100, seen=10)
    for rid in ("w1", "w2"):
        dn.admit(rid, 5.0, 336, 21)
        dn.wait_for_room(rid)
    assert dn.waiting_blocks == 42 and dn.reserved_blocks == 0 and not dn.unreported
    dn.report(free=100, total=100, seen=10)  # waiting blocks survive reports
    assert dn.free_blocks() == 58
    dn.room_taken("w1")
    dn.reserved("w1", 11)
    dn.report(free=100, total=100, seen=10)  # made before w1's reservation
    assert dn.free_blocks() == 58 and dn.reserved_blocks == 21
    dn.report(free=58, total=100, seen=12)  # made after w1's and w2's (w2's answer late)
    assert dn.reserved_blocks == 0 and dn.free_blocks() == 58 - 21  # w2: counted twice
    dn.room_taken("w2")  # its Reserve was the node's 12th: a report counted it already
    assert dn.reserved_blocks == 21 and dn.free_blocks() == 37  # (never too many free)
    dn.reserved("w2", 12)
    assert dn.reserved_blocks == 0 and not dn.unreported and not dn.reserve_seq
    assert dn.free_blocks() == 58 and not dn.waiting


def test_a_prefill_retry_counts_its_blocks_until_a_report_after_its_new_reservation():
    """A prefill retry gives back the decode reservation and takes it again under a new
    id: from before the node frees the old blocks until a report made after the new
    reservation, the booking counts against the free blocks again, so a report in
    between (showing the old blocks free) does not hand them to the next request."""
    from kvmesh.services.conductor.nodes import DecodeNodeState

    dn = DecodeNodeState("d0", 16, 100, 100)
    dn.report(free=100, total=100, seen=10)
    dn.admit("r", 5.0, 336, 21)
    dn.reserved("r", 11)
    dn.report(free=79, total=100, seen=11)  # counted by the node
    assert dn.free_blocks() == 79 and not dn.unreported
    dn.rebook("r")  # the retry: counted by us again before its old blocks go
    assert dn.free_blocks() == 58
    dn.report(free=100, total=100, seen=11)  # old freed, new not made yet
    assert dn.free_blocks() == 79
    dn.reserved("r", 12)
    dn.report(free=100, total=100, seen=11)  # still made before the new reservation
    assert dn.free_blocks() == 79
    dn.report(free=79, total=100, seen=12)  # counts the new one: not twice
    assert dn.free_blocks() == 79 and not dn.unreported and not dn.reserve_seq
    dn.rebook("gone")  # a request that ended meanwhile: nothing to count
    assert dn.free_blocks() == 79


def test_a_request_waits_for_the_kv_room_that_requests_booked_there_free():
    """No decode node has room now: kvmesh admits a request to wait for the room the
    requests booked there free at their predicted ends, where its TTFT (the wait, then
    its prefill) still meets the SLO; its blocks are held for it across load reports
    until the node reserves them. Where waiting would miss the SLO, or waiting is off,
    or the policy does not predict, it is refused for KV room."""
    s = make()
    dn = s.decode["d0"]
    a = req(320, rid="a")  # 21 blocks with its 16 tokens
    da = s.decide(a)
    s.commit(a, da)
    dn.report(free=10, total=100)  # (a's blocks counted by the node now)

    def other(rid: str, ttft: float = 1000.0) -> Request:
        return Request(rid, 320, [H(1000 * ord(rid) + i) for i in range(20)], 16, ttft, 100.0)

    b = other("b")
    db = s.decide(b)
    assert db.accepted and db.route == DISAGG and db.prefill_node != da.prefill_node
    a_ends = dn.work["a"][0]
    rest = 10 + 0.1 * 320 + 20 * 100 / 1000  # b's prefill and hand-off, no queue
    assert db.estimate.ttft_ms == pytest.approx(a_ends + rest)
    assert db.estimate.queue_ms == pytest.approx(a_ends)  # the wait is its queue
    assert db.kv_wait_ms == pytest.approx(1000 * 0.95 - rest)  # the most the SLO allows
    s.commit(b, db)
    assert dn.waiting == {"b": 21} and dn.free_blocks() == 10 - 21
    pb_ = s.prefill[db.prefill_node]
    assert "b" not in pb_.queue  # waiting in the conductor: no work at the node's head
    dn.report(free=10, total=100)  # the node does not hold b's blocks yet: still counted
    assert dn.free_blocks() == -11
    assert s.decide(other("c", ttft=100.0)).reason == "kv"  # waiting would miss its SLO
    s.request_done(a, da)
    s.room_taken(b, db)
    assert not dn.waiting and dn.waiting_blocks == 0 and dn.reserved_blocks == 21
    assert "b" in pb_.queue  # its prefill is queued from now on
    s.request_done(b, db)
    assert dn.reserved_blocks == 0 and not dn.work

    for policy, wait in (("kvmesh", False), ("cache-load", True)):
        s = make(policy)
        s.cfg.wait_for_kv = wait
        a = req(320, rid="a")
        da = s.decide(a)
        s.commit(a, da)
        s.decode["d0"].report(free=10, total=100)
        assert s.decide(other("b")).reason == "kv", policy


def test_a_request_that_ends_while_it_waits_for_kv_room_gives_its_blocks_back():
    s = make()
    dn = s.decode["d0"]
    a = req(320, rid="a")
    da = s.decide(a)
    s.commit(a, da)
    dn.report(free=10, total=100)
    b = Request("b", 320, [H(500 + i) for i in range(20)], 16, 1000.0, 100.0)
    db = s.decide(b)
    s.commit(b, db)
    assert dn.waiting_blocks == 21
    s.request_done(b, db)  # refused at the end of its wait, or its client went away
    assert dn.waiting_blocks == 0 and not dn.waiting and dn.free_blocks() == 10


def test_booking_and_release():
    s = make()
    r = req(160, rid="a")
    d = s.decide(r)
    s.commit(r, d)
    p = s.prefill[d.prefill_node]
    # the node's slot time: prefill and the handoff's tail, by its model
    assert p.queue_ms == pytest.approx(d.estimate.work_ms)
    assert d.estimate.work_ms == pytest.approx(d.estimate.prefill_ms + d.estimate.handoff_ms)
    dn = s.decode["d0"]
    assert dn.free_blocks() == 100 - 11
    # it joins the decode batch with its first token, not before
    assert dn.batch_at(0) == 0 and dn.batch_at(d.estimate.ttft_ms) == 1
    s.prefill_done(r, d, new=160, cached=0, ms=30.0, ttft_ms=30.0)
    assert p.queue_ms == 0 and len(s.ttft_error) == 1
    assert dn.batch_at(0) == 1  # its first token is out: it is in the batch now
    s.request_done(r, d, output_tokens=8)
    assert s.decode["d0"].batch_at(0) == 0


@pytest.mark.parametrize("policy", ["random", "load", "cache", "cache-load", "kvmesh"])
def test_every_policy_decides(policy):
    s = make(policy)
    s.index.stored("p1", [H(i) for i in range(8)])
    d = s.decide(req(160))
    assert d.accepted and d.decode_node == "d0"
    if policy in ("cache", "cache-load", "kvmesh"):
        assert d.prefill_node == "p1"


def test_prefill_model_learns_coefficients():
    m = PrefillModel(1, 1, 1)
    for new in (16, 64, 128, 256, 512, 1024):
        for cached in (0, 256, 1024):
            m.observe(new, cached, 3.0 + 0.02 * new + 1e-5 * new * (new + cached))
    m.fit()
    assert m.predict(300, 100) == pytest.approx(3.0 + 6.0 + 1e-5 * 300 * 400, rel=1e-3)
    assert m.coef[0] >= 0 and m.coef[1] >= 0 and m.coef[2] >= 0


def test_index_longest_prefix_per_node_and_drop():
    idx = CacheIndex()
    idx.stored("a", [H(0), H(1), H(2)])
    idx.stored("b", [H(0), H(2)])  # a hole at block 1: only block 0 counts for b
    idx.store_stored([H(0), H(1)])
    look = idx.lookup([H(0), H(1), H(2), H(3)])
    assert look.per_node == {"a": 3, "b": 1} and look.store_prefix == 2
    idx.removed("a", [H(1)])
    assert idx.lookup([H(0), H(1), H(2)]).per_node == {"a": 1, "b": 1}
    idx.drop_node("a")
    assert idx.lookup([H(0)]).per_node == {"b": 1}


def test_spilled_blocks_cost_a_promotion():
    s = make(bandwidth=1000.0)
    s.cfg.ssd_bytes_per_ms = 500.0
    s.index.store_stored([H(i) for i in range(4)])
    s.index.store_stored([H(i) for i in range(4, 10)], tier="ssd")
    look = s.index.lookup([H(i) for i in range(10)])
    assert look.store_prefix == 10 and look.store_dram_prefix == 4
    d = s.decide(req(160))
    # 9 usable blocks: 4 from DRAM (4 ms) and 5 spilled (5 ms + 5 * 1000 B / 500 B/ms = 10 ms)
    # cost 19 ms to save 14.4 ms of compute: not worth it, so recompute
    assert d.estimate.fetch_blocks == 0
    s.index.store_stored([H(i) for i in range(4, 10)])  # DRAM replicas appear
    assert s.decide(req(160)).estimate.fetch_blocks == 9


def test_decode_only_cluster_prefills_long_prompts_on_the_decode_node():
    s = make(colocate=512)
    s.prefill.clear()
    d = s.decide(req(1200))
    assert d.accepted and d.route == COLOCATED and d.decode_node == "d0"


def test_given_index_is_used():
    idx = CacheIndex()
    assert Scheduler(index=idx).index is idx


def test_hashes_of_a_list_subclass_decide_as_a_list():
    """A request's hashes in a list subclass (a caller's own type) decide as a plain
    list does, every block usable included (compiled, the index takes a plain list)."""

    class Hashes(list):
        pass

    for n in (160, 161):  # the last block not usable / every block usable
        s, t = make(), make()
        for x in (s, t):
            x.index.stored("p1", [H(i) for i in range(8)])
        r = req(n)
        mine = Request(r.request_id, n, Hashes(r.hashes), r.max_tokens, 1000.0, 100.0)
        got, want = s.decide(mine), t.decide(r)
        assert (got.prefill_node, got.estimate.cached_blocks) == ("p1", 8)
        assert (got.route, got.prefill_node, got.estimate.ttft_ms) == (
            want.route,
            want.prefill_node,
            want.estimate.ttft_ms,
        )


def test_the_prefix_held_is_found_by_chained_hashes():
    """``held_prefix``: the longest prefix of a request's hashes that a holder's prompt
    shares (hashes are chained: equal i-th hashes mean equal first i blocks), at most
    ``most``; holders that start otherwise are skipped."""
    dn = DecodeNodeState("d", BS, 100, 100)
    for rid in ("a", "b", "c"):
        dn.admit(rid, 1.0, 10, 1)
    dn.prompt_held("a", [H(i) for i in range(10)])
    dn.prompt_held("b", [H(i) for i in range(6)] + [H(100 + i) for i in range(20)])
    dn.prompt_held("c", [H(500 + i) for i in range(30)])
    mine = [H(i) for i in range(8)] + [H(900 + i) for i in range(8)]
    assert dn.held_prefix(mine, 15) == 8  # a's first 8
    assert dn.held_prefix(mine, 5) == 5
    assert dn.held_prefix([H(i) for i in range(6)] + [H(100 + i) for i in range(30)], 99) == 26
    assert dn.held_prefix([H(777)], 5) == 0 and dn.held_prefix([], 5) == 0
    dn.finish("a")
    assert dn.held_prefix(mine, 15) == 6  # b's


def test_a_request_the_node_refuses_room_for_waits_if_its_slo_leaves_time():
    """Admission counted room that the node no longer had (its pool filled before its
    report said so): the request may wait for as long as its TTFT SLO leaves beyond its
    estimate; meanwhile its blocks count as waiting and it is off its node's queue."""
    s = make()
    dn = s.decode["d0"]
    r = req(320, rid="r")
    d = s.decide(r)
    s.commit(r, d)
    p = s.prefill[d.prefill_node]
    assert d.kv_wait_ms == 0 and "r" in p.queue and dn.reserved_blocks == 21
    assert s.kv_slack_ms(r, d) == pytest.approx(1000 * 0.95 - d.estimate.ttft_ms)
    s.await_room(r, d)
    assert "r" not in p.queue and dn.reserved_blocks == 0 and dn.waiting == {"r": 21}
    s.room_taken(r, d)
    assert "r" in p.queue and dn.reserved_blocks == 21 and not dn.waiting
    s.cfg.wait_for_kv = False
    assert s.kv_slack_ms(r, d) == 0.0


def test_waiters_take_room_in_the_order_they_began_waiting():
    """A waiter asks the node only once the conductor sees its room (the report's free
    blocks, which leave out what running requests grow into, less what is booked since
    and what the waiters ahead of it hold); the room a request frees as it ends counts
    from the node's next report (the node frees its blocks; each report wakes waiters)."""
    dn = DecodeNodeState("d", BS, 100, 100)
    for rid, blocks in (("run", 30), ("w1", 20), ("w2", 10)):
        dn.admit(rid, 5.0, 10, blocks)
    dn.report(free=25, total=100)  # "run" is on the node now
    dn.wait_for_room("w1")
    dn.wait_for_room("w2")
    assert dn.room_for("w1") and not dn.room_for("w2")  # 25 - 20 ahead < 10
    dn.room_taken("w1")
    assert dn.reserved_blocks == 20 and not dn.room_for("w2")  # 25 - 20 booked < 10
    dn.finish("run")  # ended: the node frees its 30 blocks
    assert not dn.room_for("w2")  # (not yet reported)
    dn.report(free=55, total=100)
    assert dn.room_for("w2")
