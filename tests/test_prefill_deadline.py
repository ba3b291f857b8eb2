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
    s.observe(100.0, 300.0, now=0.4)  # other processes take the CPU: 3x slower
    assert s.factor(0.4) == pytest.approx(3.0)  # the latest, not the mean of 1.5
    s.observe(100.0, 100.0, now=0.5)  # one fast request: the mean still says slow
    assert s.factor(0.5) == pytest.approx((1 + 1 + 3 + 1) / 4)


def test_slowdown_forgets_a_stall_after_its_horizon():
    """One request held up for seconds must not keep the node refusing work after it."""
    s = Slowdown(window=4, horizon_s=3.0)
    s.observe(100.0, 5000.0, now=10.0)
    assert s.factor(10.0) == pytest.approx(50.0)
    assert s.factor(13.5) == 1.0
    s.observe(0.0, 50.0, now=14.0)  # no estimate: no sample
    assert s.factor(14.0) == 1.0


def test_deadline_refuses_only_what_cannot_finish_in_time():
    s = Slowdown()
    assert Deadline.of(0.0, 100.0) is None  # no deadline: never refused
    d = Deadline.of(1000.0, 200.0, now=0.0)
    assert d is not None
    assert d.wait_limit_s(s, now=0.0) == pytest.approx(0.8)
    d.check(s, waited_s=0.8, now=0.8)  # starts just in time
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

        async def holder():
            async with q.turn():
                order.append("a")
                await release.wait()

        async def short():
            try:
                async with q.turn(0.05):
                    order.append("b")
            except NotInTime:
                order.append("b left")

        async def patient():
            async with q.turn(30.0):
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
            async with q.turn(0.0):
                pass
        assert q.depth == 0

    asyncio.run(main())
