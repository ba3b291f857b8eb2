"""The prefill node's deadline logic (unit): how much slower than estimated the node runs,
when a queued request can no longer finish inside its TTFT deadline, and a compute queue
that a request leaves once it has waited all it could. The cluster-level behaviour (a
refused request does no work and frees its reservation) is in tests/test_cancel.py."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.services.prefill.deadline import Deadline, Slowdown, TooLate
from kvmesh.services.prefill.queue import ComputeQueue, NotInTime


def test_slowdown_is_one_without_samples_and_follows_a_sudden_slowdown_at_once():
    s = Slowdown(window=4, horizon_s=3.0)
    assert s.factor(0.0) == 1.0
    for t in range(3):
        s.observe(100.0, 100.0, now=float(t) / 10)
    assert s.factor(0.3) == pytest.approx(1.0)
    s.observe(100.0, 250.0, now=0.4)  # other processes take the CPU: 2.5x slower
    assert s.factor(0.4) == pytest.approx(2.5)  # the latest, not the window's 1.375
    s.observe(100.0, 100.0, now=0.5)  # one fast request: the window still says slow
    assert s.factor(0.5) == pytest.approx((100 + 100 + 250 + 100) / 400)


def test_slowdown_weighs_by_time_and_is_capped():
    s = Slowdown(window=4, horizon_s=3.0, cap=3.0)
    s.observe(400.0, 400.0, now=0.0)
    s.observe(10.0, 30.0, now=0.1)  # a short request 3x over: little time, little weight
    assert s.factor(0.1) == pytest.approx(3.0)  # the latest one
    s.observe(400.0, 400.0, now=0.2)
    assert s.factor(0.2) == pytest.approx(830 / 810)  # not the mean ratio of 1.67
    s.observe(100.0, 10_000.0, now=0.3)  # a stall: 100x
    assert s.factor(0.3) == 3.0


def test_slowdown_ignores_what_says_nothing_about_speed():
    s = Slowdown(min_expected_ms=5.0)
    s.observe(1.0, 50.0, now=0.0)  # fixed costs swamp a 1 ms estimate
    s.observe(0.0, 50.0, now=0.0)  # no estimate
    # the estimate had 100 tokens cached; the prefix was gone and all 600 were computed
    s.observe(100.0, 600.0, now=0.0, expected_tokens=100, computed_tokens=600)
    assert s.factor(0.0) == 1.0
    s.observe(100.0, 200.0, now=0.0, expected_tokens=600, computed_tokens=100)  # fewer: counts
    assert s.factor(0.0) == pytest.approx(2.0)


def test_slowdown_forgets_a_stall_after_its_horizon():
    """One request held up for seconds must not keep the node refusing work after it."""
    s = Slowdown(window=4, horizon_s=3.0)
    s.observe(100.0, 5000.0, now=10.0)
    assert s.factor(10.0) == 3.0
    assert s.factor(13.5) == 1.0


def test_deadline_refuses_only_what_cannot_finish_in_time():
    s = Slowdown()
    assert Deadline.of(0.0, 100.0) is None  # no deadline: never refused
    d = Deadline.of(1000.0, 200.0, now=0.0)
    assert d is not None
    assert d.wait_limit_s(s, now=0.0) == pytest.approx(0.8)
    d.check(s, waited_s=0.79, now=0.79)  # starts in time
    with pytest.raises(TooLate, match="past its TTFT deadline"):
        d.check(s, waited_s=0.81, now=0.81)
    s.observe(100.0, 250.0, now=0.0)  # the node runs 2.5x slower than estimated
    assert d.wait_limit_s(s, now=0.0) == pytest.approx(0.5)
    with pytest.raises(TooLate, match=r"x 2\.50"):
        d.check(s, waited_s=0.6, now=0.6)


def test_compute_queue_lets_a_waiter_leave_at_its_limit_and_serves_the_next():
    async def main():
        q = ComputeQueue()
        order: list[str] = []
        release = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def holder():
            async with q.turn():
                order.append("a")
                await release.wait()

        async def short():
            until = loop.time() + 0.05
            try:
                async with q.turn(lambda: until - loop.time()):
                    order.append("b")
            except NotInTime:
                order.append("b left")

        async def patient():
            async with q.turn(lambda: 30.0):
                order.append("c")

        ta = asyncio.create_task(holder())
        await asyncio.sleep(0)
        tb, tc = asyncio.create_task(short()), asyncio.create_task(patient())
        await asyncio.sleep(0.01)
        assert q.depth == 2
        await tb  # b's limit passes while a holds the slot
        assert q.depth == 1 and order == ["a", "b left"]
        release.set()
        await asyncio.gather(ta, tc)
        assert order == ["a", "b left", "c"] and q.depth == 0 and not q.busy
        with pytest.raises(NotInTime):  # no time left at all: not even queued
            async with q.turn(lambda: 0.0):
                pass
        assert q.depth == 0

    asyncio.run(main())


def test_a_waiter_whose_limit_grows_keeps_its_place():
    """The node sped up while x waited: x is served in its turn, before later arrivals,
    not sent to the back of the queue."""

    async def main():
        q = ComputeQueue()
        order: list[str] = []
        release = asyncio.Event()
        loop = asyncio.get_running_loop()
        until = [loop.time() + 0.05]

        async def holder():
            async with q.turn():
                await release.wait()

        async def x():
            async with q.turn(lambda: until[0] - loop.time()):
                order.append("x")

        async def later(name):
            async with q.turn(lambda: 30.0):
                order.append(name)

        ta = asyncio.create_task(holder())
        await asyncio.sleep(0)
        tx = asyncio.create_task(x())
        await asyncio.sleep(0.01)
        until[0] = loop.time() + 30  # the node sped up: x may wait longer now
        tl = [asyncio.create_task(later(f"l{i}")) for i in range(3)]
        await asyncio.sleep(0.3)  # past x's first limit
        release.set()
        await asyncio.gather(ta, tx, *tl)
        assert order == ["x", "l0", "l1", "l2"]

    asyncio.run(main())


def test_a_waiter_cancelled_as_it_is_handed_the_slot_passes_it_on():
    async def main():
        for _ in range(50):
            q = ComputeQueue()
            got: list[str] = []

            async def holder():
                async with q.turn():
                    await asyncio.sleep(0.001)

            async def waiter():
                async with q.turn(lambda: 30.0):
                    got.append("w")

            async def after():
                async with q.turn():
                    got.append("after")

            ta = asyncio.create_task(holder())
            await asyncio.sleep(0)
            tw = asyncio.create_task(waiter())
            tn = asyncio.create_task(after())
            await asyncio.sleep(0.001)
            tw.cancel()
            await asyncio.gather(ta, tw, tn, return_exceptions=True)
            assert "after" in got and not q.busy and q.depth == 0

    asyncio.run(main())
