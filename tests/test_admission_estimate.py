"""The admission estimate against hand-computed numbers (fake clock, fixed models; no
cluster): the queue term is everything ahead of the request in the prefill node's FIFO at
the node's measured rate, less the part of the running prefill already done; the TBT
check counts the decode batch at the moment the request joins it; admission allows for
how late recent estimates turned out. Each test fails on the formula it names being
wrong (no credit, no place in the queue, a stale rate, a batch counted at booking)."""

from __future__ import annotations

import pytest

from kvmesh.services.conductor.estimator import DecodeModel, ErrorTail, MeasuredRate, PrefillModel
from kvmesh.services.conductor.policy import (
    DISAGG,
    DecodeNodeState,
    PolicyConfig,
    PrefillNodeState,
    Request,
    Scheduler,
)

BS = 16
WORK = 10 + 0.1 * 160  # PrefillModel(10, 0.1, 0) on a 160-token prompt: 26 ms


def make(margin: float = 1.0) -> Scheduler:
    now = {"t": 0.0}
    s = Scheduler(
        PolicyConfig(
            policy="kvmesh", colocate_below_tokens=0, disagg_overhead_ms=0.0, slo_margin=margin
        ),
        clock=lambda: now["t"],
    )
    s.now = now  # type: ignore[attr-defined]
    # layer_nbytes 0: no handoff, so a request's slot time is its prefill alone
    s.prefill["p0"] = PrefillNodeState("p0", BS, 1000, 0, PrefillModel(10, 0.1, 0), 1000.0)
    s.decode["d0"] = DecodeNodeState(
        "d0", BS, 10_000, 10_000, DecodeModel(5, 1, 0), PrefillModel(10, 0.1, 0)
    )
    return s


def req(rid: str, ttft: float = 10_000.0, tbt: float = 1000.0, n: int = 160) -> Request:
    return Request(rid, n, [bytes([i]) * 16 for i in range(n // BS)], 4, ttft, tbt)


def book(s: Scheduler, rid: str, **kw):
    r = req(rid, **kw)
    d = s.decide(r)
    assert d.accepted, d.message
    s.commit(r, d)
    return r, d


def test_a_request_waits_for_everything_ahead_of_it_in_the_fifo():
    s = make()
    ttfts = [book(s, rid)[1].estimate.ttft_ms for rid in "abc"]
    # each waits for all those booked before it: 1, 2, 3 slot times
    assert ttfts == pytest.approx([WORK, 2 * WORK, 3 * WORK])
    r_a, d_a = book(s, "d")  # a fourth, behind three
    assert d_a.estimate.queue_ms == pytest.approx(3 * WORK)


def test_the_running_prefill_is_credited_with_the_part_already_done():
    s = make()
    (ra, da), _, _ = (book(s, rid) for rid in "abc")
    s.now["t"] = WORK  # a's first token: b starts on the node now
    s.prefill_done(ra, da, 160, 0, node_ms=WORK)
    assert s.decide(req("x")).estimate.queue_ms == pytest.approx(2 * WORK)  # b and c
    s.now["t"] = WORK + 10.0  # b has run 10 ms of its 26
    assert s.decide(req("x")).estimate.queue_ms == pytest.approx(2 * WORK - 10.0)


def test_a_head_running_past_its_prediction_slows_the_whole_estimate():
    s = make()
    book(s, "a")
    book(s, "b")
    s.now["t"] = 2 * WORK  # a has run twice its prediction and is not done
    speed = 2.0
    d = s.decide(req("x"))
    # a: done as far as we know (credit = elapsed); b and this one at the slower speed
    assert d.estimate.queue_ms == pytest.approx(WORK * speed)
    assert d.estimate.ttft_ms == pytest.approx(2 * WORK * speed)


def test_the_measured_rate_scales_queue_and_prefill_against_the_current_fit():
    s = make()
    p = s.prefill["p0"]
    # the node takes twice what its model says (the first prefill is its warm-up, then
    # enough to be trusted in full)
    for i in range(p.rate.warmup + p.rate.least):
        r, d = book(s, f"r{i}")
        s.now["t"] += 2 * WORK
        s.prefill_done(r, d, 160, 0, node_ms=2 * WORK)
    assert p.rate.factor(p.model) == pytest.approx(2.0)
    assert p.rate.tokens_per_s == pytest.approx(160 / (2 * WORK) * 1000)
    book(s, "q")
    d = s.decide(req("x"))
    assert d.estimate.prefill_ms == pytest.approx(2 * WORK)
    assert d.estimate.queue_ms == pytest.approx(2 * WORK)  # q, at the measured rate
    # the model is refit to the slower node: the rate is measured against the new fit,
    # not multiplied onto it a second time
    p.model.coef = [20.0, 0.2, 0.0]
    assert p.rate.factor(p.model) == pytest.approx(1.0)
    assert s.decide(req("y")).estimate.prefill_ms == pytest.approx(2 * WORK)


def test_measured_rate_is_the_median_of_recent_prefills():
    rate, model = MeasuredRate(window=5), PrefillModel(10, 0.1, 0)
    assert rate.factor(model) == 1.0  # nothing measured yet
    for ms in (26, 26, 260, 52, 52):  # one outlier does not move it
        rate.observe(160, 0, 0.0, ms)
    assert rate.factor(model) == pytest.approx(2.0)
    for _ in range(5):  # the window keeps the last five
        rate.observe(160, 0, 0.0, 26)
    assert rate.factor(model) == pytest.approx(1.0)


def test_the_tbt_check_counts_the_batch_when_the_request_joins_it():
    s = make()
    dn = s.decode["d0"]
    for i in range(3):
        dn.admit(f"run{i}", end=1000.0, kv=0, blocks=0)  # decoding now
    dn.admit("ending", end=20.0, kv=0, blocks=0)  # done before our first token
    dn.admit("late0", end=2000.0, kv=0, blocks=0, join=500.0)  # still prefilling then
    dn.admit("late1", end=2000.0, kv=0, blocks=0, join=500.0)
    assert [dn.batch_at(t) for t in (0.0, 30.0, 600.0)] == [4, 3, 5]
    # a step of a batch of B takes 5 + B ms; 9 ms allows 3 others beside this request
    d = s.decide(req("x", tbt=9.0))
    assert d.accepted and d.tbt_ms == pytest.approx(9.0)
    # behind 600 ms of queue the two late ones have joined: 5 others, 11 ms
    s.prefill["p0"].enqueue("busy", 600.0)
    d = s.decide(req("y", tbt=9.0))
    assert not d.accepted and d.reason == "tbt" and "11.0 ms" in d.message


def test_a_first_token_moves_the_join_to_when_it_came():
    s = make()
    r, d = book(s, "a")
    dn = s.decode["d0"]
    assert dn.batch_at(0.0) == 0 and dn.batch_at(WORK) == 1
    s.now["t"] = 5.0
    s.prefill_done(r, d, 160, 0)  # earlier than estimated
    assert dn.batch_at(5.0) == 1
    s.request_done(r, d)
    assert dn.batch_at(5.0) == 0 and not dn.joins and not dn.ends


def test_admission_allows_for_how_late_recent_estimates_came():
    s = make()
    s.error_tail[DISAGG] = ErrorTail(least=1)
    r, d = book(s, "r")  # its first token took twice the estimate
    s.prefill_done(r, d, 160, 0, ttft_ms=2 * d.estimate.ttft_ms)
    s.request_done(r, d)
    s.overhead_ms[DISAGG] = 0.0  # (what the TTFT also taught the route's overhead)
    assert s.error_tail[DISAGG].value == pytest.approx(2.0)
    d = s.decide(req("x", ttft=40.0))  # 26 ms fits 40, twice 26 does not
    assert not d.accepted and d.reason == "ttft" and "x2.00" in d.message
    assert s.decide(req("y", ttft=60.0)).accepted


def test_an_estimate_is_scaled_by_the_tail_of_estimates_of_its_size():
    tail = ErrorTail(least=3, least_sized=3)
    for _ in range(5):  # short ones (< 1/16 of the SLO): a few ms of jitter doubles them
        tail.add(20, 40, limit=1000)
    assert tail.value == pytest.approx(2.0)
    # none of the other sizes yet: each follows the one below it
    assert tail.mid_value == pytest.approx(2.0) and tail.near_value == pytest.approx(2.0)
    for _ in range(3):  # 1/16 to 1/4 of the SLO: 30% late
        tail.add(100, 130, limit=1000)
    assert tail.mid_value == pytest.approx(1.3)
    assert tail.near_value == pytest.approx(1.3)  # (no near one yet: the mid tail)
    for _ in range(3):  # a quarter of the SLO or more: 10% late
        tail.add(500, 550, limit=1000)
    assert tail.value == pytest.approx(2.0) and tail.near_value == pytest.approx(1.1)
    assert tail.mid_value == pytest.approx(1.3)  # (the near ones are mid ones too)
    assert tail.factor(600, 950) == pytest.approx(1.1)
    assert tail.factor(100, 950) == pytest.approx(1.3)
    assert tail.factor(50, 950) == pytest.approx(2.0)
    for _ in range(20):  # short ones without an SLO join the first window only
        tail.add(20, 20)
    assert tail.near_value == pytest.approx(1.1) and tail.mid_value == pytest.approx(1.3)
    # and where the long ones are the late ones, they are scaled by more, not less
    slow = ErrorTail(least=3, least_sized=3)
    for _ in range(5):
        slow.add(20, 20, limit=1000)
        slow.add(800, 2400, limit=1000)
    assert slow.factor(900, 950) == pytest.approx(3.0)


def test_a_window_of_a_size_counts_only_once_it_holds_enough_ratios():
    tail = ErrorTail(least=3, least_sized=4)
    for _ in range(5):
        tail.add(20, 40, limit=1000)
    for _ in range(3):  # the worst of three near ones is no tail yet: the tail of all
        tail.add(500, 510, limit=1000)
    assert tail.near_value == pytest.approx(2.0) and tail.factor(600, 950) == 2.0
    tail.add(500, 510, limit=1000)
    assert tail.near_value == pytest.approx(1.02)


def test_a_sized_tail_is_no_higher_than_the_tail_of_all():
    """A few late near-SLO estimates (the queue behind one long prefill) must not keep
    scaling near-SLO estimates once every recent request has come on time: that factor
    refuses the near-SLO requests whose ratios would move their window, so before the cap
    it held until 50 more of them got in (in the paper-scale simulation, the whole last
    third of the trace at 2.8x)."""
    tail = ErrorTail(window=10, least=3, least_sized=3)
    for _ in range(3):
        tail.add(500, 1500, limit=1000)  # near the SLO, 3x late
    assert tail.near_value == pytest.approx(3.0) and tail.factor(600, 950) == 3.0
    for _ in range(10):  # then ten shorter ones on time: the late ones leave the window
        tail.add(100, 100, limit=1000)
    assert tail.value == pytest.approx(1.0) and tail.mid_value == pytest.approx(1.0)
    assert tail.near_value == pytest.approx(1.0) and tail.factor(600, 950) == 1.0
    tail.add(500, 1000, limit=1000)  # a late near one counts while it is recent
    assert tail.value == pytest.approx(2.0) and tail.factor(600, 950) == pytest.approx(2.0)


def test_admission_scales_a_near_slo_estimate_by_the_near_tail():
    s = make()
    et = ErrorTail(least=1, least_sized=1)
    s.error_tail[DISAGG] = et
    et.add(10, 20, limit=1000)  # a short estimate came twice late: every estimate x2
    assert not s.decide(req("x", ttft=40.0)).accepted  # 26 ms x 2 > 40
    et.add(5, 15, limit=40)  # one of 1/16 to 1/4 of the SLO came 3x late
    assert et.mid_value == pytest.approx(3.0)
    et.add(26, 27, limit=40)  # one of a quarter or more came 4% late
    d = s.decide(req("y", ttft=40.0))  # 26 >= 40 / 4: scaled by 27/26, not by 3 or 2
    assert d.accepted, d.message
    et.add(26, 52, limit=40)  # and one came twice late: refused, and the message says x2
    d = s.decide(req("z", ttft=40.0))
    assert not d.accepted and "x2.00" in d.message


def test_a_tail_raised_by_a_burst_comes_down_once_the_burst_is_past_the_horizon():
    """The absorbing state the long-prompt evaluation fell into: a burst of late TTFTs
    raised the tail, the tail refused every near-SLO request, and so no ratio could ever
    lower it again (150 of 150 refused at a fifth of the burst's rate). Ratios older than
    the horizon leave it; fresh ones within it still count."""
    s = make()
    horizon_ms = 1000.0 * s.cfg.error_tail_horizon_s
    et = s.error_tail[DISAGG]
    for i in range(60):  # a burst: every near-SLO estimate came twice late
        et.add(26, 52, limit=40, now=float(i))
    assert et.near_value == pytest.approx(2.0)
    s.now["t"] = horizon_ms / 2  # within the horizon: still refused
    assert not s.decide(req("x", ttft=40.0)).accepted
    s.now["t"] = 60.0 + horizon_ms  # the burst is past: the estimate is taken as it is
    d = s.decide(req("y", ttft=40.0))
    assert d.accepted, d.message
    assert et.value == et.near_value == 1.0
    for i in range(60):  # a new late burst counts at once
        et.add(26, 52, limit=40, now=s.now["t"] + i)
    s.now["t"] += 100.0
    assert not s.decide(req("z", ttft=40.0)).accepted


def test_an_estimate_that_waits_on_nothing_is_scaled_by_the_tail_of_such_estimates():
    """Queued estimates came twice late (an overload); those of an idle node came on
    time: a near-SLO request to an idle node is scaled by the idle tail and accepted, a
    queued one still by the tail of all."""
    et = ErrorTail(least=3, least_sized=3)
    for i in range(3):  # on idle nodes (no wait): on time
        et.add(30, 30, limit=40, wait=0.0, now=float(i))
    for i in range(10):  # behind a queue: twice late
        et.add(30, 60, limit=40, wait=20.0, now=10.0 + i)
    assert et.near_value == pytest.approx(2.0) and et.idle_value == pytest.approx(1.0)
    assert et.factor(30, 40, wait=0.0) == pytest.approx(1.0)
    assert et.factor(30, 40, wait=20.0) == pytest.approx(2.0)
    assert et.factor(30, 40) == pytest.approx(2.0)  # (its wait not known)
    s = make()
    s.error_tail[DISAGG] = et
    s.now["t"] = 100.0
    d = s.decide(req("idle", ttft=40.0))  # 26 ms, nothing queued: x1, inside 40
    assert d.accepted, d.message
    s.commit(req("idle", ttft=40.0), d)  # now the next one waits behind it: x2
    d = s.decide(req("queued", ttft=60.0))
    assert not d.accepted and "x2.00" in d.message


def test_error_tail_is_a_high_quantile_of_recent_ratios():
    tail = ErrorTail(window=10, quantile=0.9, least=3)
    tail.add(100, 300)
    tail.add(100, 90)
    assert tail.value == 1.0  # too few to say
    for _ in range(8):
        tail.add(100, 90)
    assert tail.value == pytest.approx(3.0)  # the slow one is within the window's top 10%
    tail.add(100, 90)  # and leaves it
    assert tail.value == pytest.approx(0.9)


def test_a_node_slowed_by_load_is_no_floor():
    """Measured 3x slower than its model, the node misses a 40 ms SLO now (a 429 with a
    retry), but the SLO is not below what it does idle at its usual speed (no 400)."""
    s = make()
    p = s.prefill["p0"]
    for _ in range(p.rate.warmup + p.rate.least):
        p.rate.observe(160, 0, 0.0, 3 * WORK)
    d = s.decide(req("x", ttft=40.0))
    assert not d.accepted and d.reason == "ttft" and d.retry_after_ms > 0
    d = s.decide(req("y", ttft=20.0))  # below even the model's 26 ms
    assert not d.accepted and d.reason == "infeasible" and "26.0 ms" in d.message


def test_measured_rate_shows_a_slowdown_within_two_prefills():
    rate, model = MeasuredRate(window=20), PrefillModel(10, 0.1, 0)
    for _ in range(20):
        rate.observe(160, 0, 0.0, WORK)
    rate.observe(160, 0, 0.0, 3 * WORK)  # one slow prefill: noise
    assert rate.factor(model) == pytest.approx(1.0)
    rate.observe(160, 0, 0.0, 3 * WORK)  # two of the last three: the node is slower now
    assert rate.factor(model) == pytest.approx(3.0)
    for _ in range(3):  # fast again: the last three say so
        rate.observe(160, 0, 0.0, WORK)
    assert rate.factor(model) == pytest.approx(1.0)
