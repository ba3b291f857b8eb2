"""The remote slot pool's limits, as real processes (a client that lends nothing, a
store-node that holds the segment): concurrent puts never make a client hold more than
its budget, one size's slots never lock another size out of the pool, a PUT_SLOTS refill
is capped, the master grants spare slots only from a share of a segment's free space, a
holder that dies or hangs takes its pooled slots with it (the keys go to a live one), a
slot with too little time left is not written, a closing client gives its slots back
(PUT_RELEASE), also those a commit in flight brings, and a put cancelled mid-write
leaves no region registered nor anything counted busy; PUT_RELEASE's bad input gets a
clear status (review of issue 13's large pooled puts)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from kvmesh.loadtest.store_cluster import NODE_PREFIX, StoreCluster
from kvmesh.rdma import TransferEngine
from kvmesh.services.store.client import StoreClient
from kvmesh.services.store.fastconn import FastConn
from kvmesh.services.store_master import wire
from kvmesh.services.store_master.slots import REMOTE_SPARE_SHARE
from tests.store_util import INVALID, fast_address, fast_call, run_client, running_store

MiB = 1 << 20


@pytest.fixture
def store(tmp_path):
    with running_store(str(tmp_path), nodes=1, segment="256MiB") as c:
        yield c


def run(master: str, fn, **kw):
    return run_client(master, fn, "pool-tester", **kw)


def spy_frames(monkeypatch) -> list[tuple[int, bytes]]:
    """(method, body) of every fast-path frame sent from now on."""
    sent: list[tuple[int, bytes]] = []
    real = FastConn.call

    def spy(self, method, body, timeout):
        sent.append((method, bytes(body)))
        return real(self, method, body, timeout)

    monkeypatch.setattr(FastConn, "call", spy)
    return sent


def released(sent: list[tuple[int, bytes]]) -> list[tuple[int, int]]:
    """The (offset, token) slots named by the PUT_RELEASE frames in ``sent``."""
    return [x for m, b in sent if m == wire.PUT_RELEASE for x in wire.unpack_put_release(b)[3]]


def test_concurrent_large_puts_hold_at_most_the_budget(store, monkeypatch):
    """8 concurrent 4 MiB puts (each found the pool empty): as the frames sent show, at
    most one PUT_RESERVE per size is in flight and none asks for more than the budget,
    the master holds no more than the values plus the budget, and every value comes
    back."""
    vals = [os.urandom(4 * MiB) for _ in range(8)]
    keys = [f"conc-{i}".encode() for i in range(8)]
    base = store.stats().bytes_used
    inflight: dict[int, int] = {}
    worst: dict[int, int] = {}
    asked: list[tuple[int, int]] = []
    real = FastConn.call

    def spy(self, method, body, timeout):
        fut = real(self, method, body, timeout)
        if method == wire.PUT_RESERVE:
            _, size, count, spare = wire.unpack_put_reserve(bytes(body))
            asked.append((size, count + spare))
            inflight[size] = inflight.get(size, 0) + 1
            worst[size] = max(worst.get(size, 0), inflight[size])

            def answered(_f, size=size):
                inflight[size] -= 1

            fut.add_done_callback(answered)
        return fut

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.exists(b"warm-up") is False
        monkeypatch.setattr(FastConn, "call", spy)
        ok = await asyncio.gather(*[cl.put(k, v) for k, v in zip(keys, vals)])
        monkeypatch.undo()
        assert ok == [True] * 8
        held = cl._rslots.held_bytes()
        assert cl._rslots.busy == {} or set(cl._rslots.busy.values()) == {0}
        used = store.stats().bytes_used - base
        assert await cl.batch_get(keys) == vals
        return held, used, cl._rslots.max_bytes

    held, used, budget = run(store.master, body)
    assert asked and worst == {4 * MiB: 1}, (asked, worst)
    assert all(n * size <= budget for size, n in asked), asked
    assert held <= budget, (held, budget)
    assert used <= 8 * 4 * MiB + budget, (used / MiB, budget / MiB)


def test_one_size_does_not_lock_another_out_of_the_pool(store, monkeypatch):
    """A 4 MiB put leaves spare 4 MiB slots holding most of the budget; a 16 MiB put on
    the same client gives the oldest of them back (PUT_RELEASE, only as many as it
    needs) and goes through the pool (PUT_RESERVE, write, PUT_SLOTS), never
    PUT_START/PUT_END (before: the 4 MiB slots held the budget for good)."""
    small, big = os.urandom(4 * MiB), os.urandom(16 * MiB)

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.put(b"lock-small", small)
        rp = cl._rslots
        before = list(rp.slots[4 * MiB])
        assert rp.room(16 * MiB) == 0  # the test means something: no room as it was
        sent = spy_frames(monkeypatch)
        assert await cl.put(b"lock-big", big)
        assert [m for m, _ in sent] == [wire.PUT_RELEASE, wire.PUT_RESERVE, wire.PUT_SLOTS]
        _, _, size, gone = wire.unpack_put_release(sent[0][1])
        kept = rp.slots.get(4 * MiB, [])
        assert size == 4 * MiB and gone and len(gone) + len(kept) == len(before)
        assert (len(kept) + 1) * 4 * MiB + 16 * MiB > rp.max_bytes  # no more than needed
        assert rp.held_bytes() <= rp.max_bytes
        monkeypatch.undo()
        assert await cl.batch_get([b"lock-small", b"lock-big"]) == [small, big]

    run(store.master, body)


def test_the_put_slots_refill_is_capped_by_a_share_of_the_free_space(store):
    """A PUT_SLOTS commit asking for 60 more 4 MiB slots on a 256 MiB segment gets only
    what REMOTE_SPARE_SHARE of the free space holds (not up to the eviction watermark)."""
    addr = fast_address(store)
    status, body = fast_call(
        addr, wire.PUT_RESERVE, wire.pack_put_reserve("refiller", 4 * MiB, 1, 0)
    )
    assert status == 0
    _, region, _, node, token, (off,) = wire.unpack_put_reserve_resp(body)
    free = 256 * MiB - store.stats().bytes_used
    frame = wire.pack_put_slots(node, region, [b"refill-cap"], 4 * MiB, [off], [token], 60)
    status, body = fast_call(addr, wire.PUT_SLOTS, frame)
    assert status == 0
    st, tok2, new = wire.unpack_put_slots_resp(body, 1)
    assert st == [1] and 1 <= len(new) <= int(free * REMOTE_SPARE_SHARE) // (4 * MiB)
    rel = wire.pack_put_release(node, region, 4 * MiB, [(o, tok2) for o in new])
    status, body = fast_call(addr, wire.PUT_RELEASE, rel)
    assert status == 0 and wire.unpack_count(body) == len(new)


def test_spare_slots_come_from_a_share_of_the_free_space(store):
    """PUT_RESERVE of 1 slot and 60 spare 4 MiB slots on a 256 MiB segment: the spare
    ones fit in REMOTE_SPARE_SHARE of the free space (not the whole segment)."""
    addr = fast_address(store)
    status, body = fast_call(
        addr, wire.PUT_RESERVE, wire.pack_put_reserve("greedy", 4 * MiB, 1, 60)
    )
    assert status == 0
    _, region, _, node, token, offs = wire.unpack_put_reserve_resp(body)
    cap = int(256 * MiB * REMOTE_SPARE_SHARE) // (4 * MiB)
    assert 1 <= len(offs) <= 1 + cap, len(offs)
    # and they are given back with PUT_RELEASE (a wrong token frees nothing)
    rel = [(o, token) for o in offs]
    used = store.stats().bytes_used
    status, body = fast_call(
        addr, wire.PUT_RELEASE, wire.pack_put_release(node, region, 4 * MiB, [(offs[0], token ^ 1)])
    )
    assert status == 0 and wire.unpack_count(body) == 0
    status, body = fast_call(
        addr, wire.PUT_RELEASE, wire.pack_put_release(node, region, 4 * MiB, rel)
    )
    assert status == 0 and wire.unpack_count(body) == len(offs)
    assert store.stats().bytes_used == used - len(offs) * 4 * MiB


def test_put_release_bad_input_gets_a_clear_status(store):
    addr = fast_address(store)
    ok = wire.pack_put_release("nobody", 0, 4096, [(0, 1), (4096, 1)])
    at = 1 + len("nobody") + 4 + 8
    cases = {
        "truncated": ok[:-3],
        "trailing": ok + b"\0",
        "lying count": ok[:at] + (9).to_bytes(4, "little") + ok[at + 4 :],
        "short head": ok[:at],
        "zero size": wire.pack_put_release("nobody", 0, 0, [(0, 1)]),
        "too many": wire.pack_put_release("nobody", 0, 4096, [(i, 1) for i in range(70_000)]),
    }
    for what, body in cases.items():
        status, msg = fast_call(addr, wire.PUT_RELEASE, body)
        assert status == INVALID and msg, (what, status, msg)
    status, body = fast_call(addr, wire.PUT_RELEASE, ok)  # nobody holds them: nothing freed
    assert status == 0 and wire.unpack_count(body) == 0


def test_closing_gives_the_pooled_slots_back(store):
    """A client that put one 4 MiB value holds spare slots on the master; after close
    the master holds only the value (not the slots until their deadline)."""
    base = store.stats().bytes_used
    val = os.urandom(4 * MiB)

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.put(b"close-key", val)
        return cl._rslots.held_bytes()

    held = run(store.master, body)
    assert held >= 4 * MiB  # the test means something: spare slots were held
    assert store.stats().bytes_used - base == 4 * MiB


def test_a_slot_about_to_expire_is_not_written(store, monkeypatch):
    """The pool's only 16 MiB slot has 50 ms left: too little for the write, so it is
    given back (PUT_RELEASE) and a fresh one reserved before anything is written
    (without the check the write went into it and missed its use-by time)."""
    val = os.urandom(16 * MiB)

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.put(b"exp-first", val)
        pool = cl._rslots.of(16 * MiB, cl._fast)
        assert pool
        del pool[1:]
        old = pool[0]
        pool[0] = (time.monotonic() + 0.05,) + old[1:]
        events: list[tuple] = []
        real_write, real_call = te.write, FastConn.call

        async def spy_write(peer, slices):
            events.append(("write", [s.remote_offset for s in slices]))
            return await real_write(peer, slices)

        def spy_call(self, method, body, timeout):
            events.append((method, bytes(body)))
            return real_call(self, method, body, timeout)

        te.write = spy_write  # type: ignore[method-assign]
        monkeypatch.setattr(FastConn, "call", spy_call)
        assert await cl.put(b"exp-second", val)
        assert [e[0] for e in events] == [
            wire.PUT_RELEASE,
            wire.PUT_RESERVE,
            "write",
            wire.PUT_SLOTS,
        ], events
        _, region, size, slots = wire.unpack_put_release(events[0][1])
        assert (region, size, slots) == (old[2], 16 * MiB, [(old[4], old[5])])
        monkeypatch.undo()
        assert await cl.get(b"exp-second") == val

    run(store.master, body)


def test_a_put_cancelled_mid_write_leaves_no_region(store):
    """A large bytes put whose write hangs, cancelled by a timeout: the transient regions
    registered for it are gone, and the pool counts nothing busy nor reserving."""
    val = os.urandom(2 * MiB)

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.exists(b"warm-up") is False
        before = te._regions.ids()
        hung = asyncio.Event()

        async def hang(peer, slices):
            hung.set()
            await asyncio.sleep(3600)

        real = te.write
        te.write = hang  # type: ignore[method-assign]
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await cl.put(b"cancelled", val)
        te.write = real  # type: ignore[method-assign]
        assert hung.is_set()
        assert te._regions.ids() == before
        assert set(cl._rslots.busy.values()) <= {0}, cl._rslots.busy
        assert cl._rslots.reserving == {}

    run(store.master, body)


def test_a_hung_holders_pooled_slots_are_dropped(store, monkeypatch):
    """A write into a pooled slot that never answers is given up at the slot's use-by
    time; the pool's other slots on that holder are dropped and given back (PUT_RELEASE),
    so the next put does not wait on it again; the key is stored through PUT_START/
    PUT_END (before: the pool kept them, and each next put waited out its slot)."""
    val = os.urandom(4 * MiB)

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.put(b"hang-first", val)
        pool = cl._rslots.of(4 * MiB, cl._fast)
        assert len(pool) >= 2
        peer = pool[0][1]
        soon = time.monotonic() + 1.0  # time enough to take, not to wait an hour
        pool[:] = [(soon,) + s[1:] for s in pool]
        held = {(s[4], s[5]) for s in pool}
        real = te.write
        writes = [0]

        async def hang_once(p, slices):
            writes[0] += 1
            if writes[0] == 1:
                await asyncio.sleep(3600)
            return await real(p, slices)

        te.write = hang_once  # type: ignore[method-assign]
        sent = spy_frames(monkeypatch)
        assert await cl.put(b"hang-second", val)
        te.write = real  # type: ignore[method-assign]
        monkeypatch.undo()
        assert writes[0] == 2  # the hung one, then the PUT_START/PUT_END one
        assert wire.PUT_START in [m for m, _ in sent]
        assert all(s[1] != peer for p in cl._rslots.slots.values() for s in p)
        gone = released(sent)
        assert len(gone) == len(held) - 1 and set(gone) < held
        assert await cl.get(b"hang-second") == val

    run(store.master, body)


def test_slots_that_come_back_while_closing_are_given_back(store, monkeypatch):
    """A put's PUT_SLOTS commit answers (with refill slots) after close() began giving
    the pool back: the refill slots are given back too (PUT_RELEASE), not put into a
    pool nobody uses (before: they stayed reserved on the master until their deadline)."""
    val = os.urandom(4 * MiB)

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.put(b"closing-first", val)
        pool = cl._rslots.of(4 * MiB, cl._fast)
        del pool[2:]  # one for the put, one for close() to give back; room to refill
        committing, closing, after = asyncio.Event(), asyncio.Event(), asyncio.Event()
        answers: list[bytes] = []
        sent: list[tuple[int, bytes]] = []
        real = FastConn.call

        def spy(self, method, body, timeout):
            sent.append((method, bytes(body)))
            fut = real(self, method, body, timeout)
            if method == wire.PUT_SLOTS:  # answered once close() gives the pool back
                committing.set()

                async def late():
                    out = await fut
                    await closing.wait()
                    answers.append(out)
                    return out

                return asyncio.ensure_future(late())
            if method == wire.PUT_RELEASE and not closing.is_set():
                closing.set()  # close()'s own: answered once the put gave back its slots

                async def held_open():
                    out = await fut
                    await after.wait()  # (close() waits 1 s at most)
                    return out

                return asyncio.ensure_future(held_open())
            if method == wire.PUT_RELEASE:
                after.set()
            return fut

        monkeypatch.setattr(FastConn, "call", spy)
        put = asyncio.create_task(cl.put(b"closing-second", val))
        await committing.wait()
        await cl.close()
        assert await put
        monkeypatch.undo()
        st, tok, new = wire.unpack_put_slots_resp(answers[0], 1)
        assert st == [1] and new  # the test means something: slots were refilled
        assert set((o, tok) for o in new) <= set(released(sent))
        assert not any(cl._rslots.slots.values())

    run(store.master, body)


def test_a_dead_holders_pooled_slots_are_dropped(tmp_path):
    """Two holders; a 4 MiB put fills the pool with slots on one, which is killed: every
    later put is stored (on the live holder), none is refused for a dead holder's slot
    (before: False until the pool's dead slots were used up)."""
    c = StoreCluster(str(tmp_path), nodes=2, segment="256MiB")
    c.start()
    try:
        val = os.urandom(4 * MiB)

        async def body(cl: StoreClient, te: TransferEngine):
            assert await cl.put(b"dies-first", val)
            pool = cl._rslots.of(4 * MiB, cl._fast)
            assert len(pool) >= 2
            holder = pool[0][3]
            assert {s[3] for s in pool} == {holder}
            name = next(n for n in c.procs if n.startswith(NODE_PREFIX) and n in holder)
            c.kill(name)
            await asyncio.to_thread(c.wait_segments, 1)
            ok = [await cl.put(f"dies-{i}".encode(), val) for i in range(len(pool) + 2)]
            assert ok == [True] * len(ok)
            assert all(s[3] != holder for p in cl._rslots.slots.values() for s in p)
            return [await cl.get(f"dies-{i}".encode()) for i in range(len(ok))]

        got = run(c.master, body)
        assert got == [val] * len(got)
    finally:
        c.stop()


def test_direct_puts_only_on_the_tcp_transport():
    """Registering a buffer per put is cheap only where it is a table entry: the TCP
    transport (its kind is its class name), never RDMA verbs nor a transport unknown."""
    from types import SimpleNamespace

    from kvmesh.services.store import direct

    big = [memoryview(bytes(direct.DIRECT_PUT_MIN))]
    for kind, want in (("TcpTransport", True), ("tcp", True), ("rdma", False), ("shm", False)):
        te = SimpleNamespace(transport_kind=kind)
        assert direct.usable(te, big) is want, kind  # type: ignore[arg-type]
    small = [memoryview(bytes(direct.DIRECT_PUT_MIN - 1))]
    assert direct.usable(SimpleNamespace(transport_kind="TcpTransport"), small) is False  # type: ignore[arg-type]
