"""The client's pool of remote slots as plain data (no processes): its byte budget is
shared by every size (review finding 5, issue 13), taking slots checks each one's use-by
time, wherever it sits in the pool (finding 4), and making room for one size drops the
slots out of time and then other sizes' oldest idle ones (second review, finding 1)."""

from __future__ import annotations

from kvmesh.services.store.remote_pool import REMOTE_POOL_MIN, RemotePool

KB = 1024


def slot(use_by: float, off: int) -> tuple[float, str, int, str, int, int]:
    return (use_by, "peer:1", 0, "node", off, 7)


def test_the_byte_budget_covers_every_size_together():
    rp = RemotePool(max_bytes=64 * KB, max_slots=32)
    conn = object()
    assert rp.target(4 * KB) == 16 and rp.target(1 * KB) == 32  # the slot cap
    rp.of(4 * KB, conn).extend(slot(10.0, i * 4 * KB) for i in range(12))  # 48 KiB held
    assert rp.target(4 * KB) == 16  # its own slots do not count against it
    assert rp.target(8 * KB) == 2  # 16 KiB left
    assert rp.target(32 * KB) == 0  # no room: such a put takes the usual path
    rp.of(8 * KB, conn).extend([slot(10.0, 1 << 20), slot(10.0, 2 << 20)])
    assert rp.target(1 * KB) == 0 and rp.target(4 * KB) == 12
    rp.of(4 * KB, object())  # another connection: every slot of the old one is dropped
    assert rp.slots == {4 * KB: []} and rp.target(32 * KB) == 2


def test_take_checks_every_slot_and_gives_back_on_a_shortfall():
    pool = [slot(5.0, 0), slot(20.0, 4096), slot(1.0, 8192), slot(20.0, 12288)]
    got = RemotePool.take(pool, 2, now=10.0)
    assert got is not None and sorted(s[4] for s in got) == [4096, 12288]
    assert pool == [slot(5.0, 0)]  # the expired one at the end was dropped on the way
    assert RemotePool.take(pool, 1, now=10.0) is None and pool == []
    pool = [slot(20.0, 0), slot(20.0, 4096)]
    assert RemotePool.take(pool, 3, now=10.0) is None
    assert sorted(s[4] for s in pool) == [0, 4096]  # given back, still usable


def test_slots_popped_or_asked_for_count_against_the_budget():
    """Busy slots (popped by a put, or asked for by a call in flight) count as held:
    the room left shrinks, trim() pops what is beyond the target, and drop_peer()
    forgets every slot on one holder whatever its size."""
    rp = RemotePool(max_bytes=32 * KB, max_slots=32)
    conn = object()
    rp.of(4 * KB, conn).extend(slot(10.0, i * 4 * KB) for i in range(4))
    assert rp.room(4 * KB) == 4
    rp.add_busy(4 * KB, 3)  # three more popped or asked for
    assert rp.held(4 * KB) == 7 and rp.room(4 * KB) == 1 and rp.held_bytes() == 28 * KB
    assert rp.target(8 * KB) == 0  # 4 KiB left: not one 8 KiB slot
    rp.of(4 * KB, conn).extend(slot(10.0, (10 + i) * 4 * KB) for i in range(3))  # 10 held
    extra = rp.trim(4 * KB)
    assert len(extra) == 2 and rp.held(4 * KB) == 8
    rp.of(8 * KB, conn).append((10.0, "peer:2", 0, "other", 0, 9))
    assert rp.drop_peer("peer:1") == 5 and rp.slots[8 * KB] and rp.slots[4 * KB] == []


def test_take_hands_back_the_slots_it_drops():
    pool = [slot(10.05, 0), slot(30.0, 4096)]
    late: list = []
    got = RemotePool.take(pool, 1, now=10.0, need_s=0.5, dropped=late)
    assert got == [slot(30.0, 4096)] and late == []  # the last one first: enough time
    assert RemotePool.take(pool, 1, now=10.0, need_s=0.5, dropped=late) is None
    assert late == [slot(10.05, 0)] and pool == []


def test_make_room_drops_slots_out_of_time_then_other_sizes_oldest_first():
    """One 4 KiB put left 7 spare 4 KiB slots (28 of 32 KiB): a 16 KiB slot has no room.
    make_room drops every slot out of time (of any size), then other sizes' idle slots,
    oldest first, only until the count fits (none if it cannot fit); never its own
    size's nor busy ones; sizes left empty are forgotten."""
    rp = RemotePool(max_bytes=32 * KB, max_slots=32)
    conn = object()
    rp.of(4 * KB, conn).extend(slot(10.0 + i, i * 4 * KB) for i in range(7))
    rp.of(1 * KB, conn).append(slot(1.0, 1 << 20))  # out of time
    rp.of(16 * KB, conn)  # an empty entry for the size asked for stays
    rp.of(2 * KB, conn)  # an empty one of another size goes
    assert rp.room(16 * KB) == 0
    out = rp.make_room(16 * KB, 1, now=9.0)
    assert rp.room(16 * KB) == 1
    assert sorted(s[4] for _, s in out) == [0, 4 * KB, 8 * KB, 1 << 20]  # oldest 4 KiB
    assert [z for z, _ in out].count(4 * KB) == 3
    assert sorted(rp.slots) == [4 * KB, 16 * KB] and len(rp.slots[4 * KB]) == 4
    # out of time at 9.9 s: slots of its own size too (a write needs write_time() left)
    rp.of(16 * KB, conn).append(slot(9.95, 2 << 20))
    out = rp.make_room(16 * KB, 0, now=9.9)
    assert [s[4] for _, s in out] == [2 << 20] and rp.slots[16 * KB] == []
    # busy slots are never dropped, and idle ones only if that makes room enough
    rp.add_busy(4 * KB, 4)
    assert rp.make_room(16 * KB, 2, now=9.0) == [] and len(rp.slots[4 * KB]) == 4
    out = rp.make_room(16 * KB, 1, now=9.0)
    assert rp.room(16 * KB) == 1 and len(out) == 4 and 4 * KB not in rp.slots


def test_a_put_asks_the_pool_for_twice_its_values_and_at_least_the_minimum():
    """The pool asks for what its puts use: a client putting one value at a time holds
    REMOTE_POOL_MIN slots, one putting batches of 128 holds 256 (the next batch's too),
    always within max_slots and the byte budget."""
    rp = RemotePool(max_bytes=32 << 20, max_slots=256)
    conn = object()
    assert rp.want(4 * KB, 1) == REMOTE_POOL_MIN == 32 and rp.spare(4 * KB, 1) == 32
    assert rp.want(4 * KB, 128) == 256 and rp.want(4 * KB, 200) == 256  # max_slots
    assert rp.want(1 << 20, 128) == 32  # the byte budget: 32 MiB of 1 MiB slots
    rp.of(4 * KB, conn).extend(slot(10.0, i * 4 * KB) for i in range(20))
    rp.add_busy(4 * KB, 4)  # popped by puts in flight: held too
    assert rp.spare(4 * KB, 1) == 8 and rp.spare(4 * KB, 128) == 232
