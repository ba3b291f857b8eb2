"""Store metadata logic under a fake clock: placement, put timeout, leases vs eviction,
pins, watermarks, multi-replica hot blocks, spill/promote plans, re-report, events."""

from __future__ import annotations

import time

from kvmesh.services.store_master.metadata import DRAM, SSD, BlockState, StoreMetadata

KB = 1024


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def make(**kw):
    clock = Clock()
    events = []
    m = StoreMetadata(
        clock=clock,
        on_event=lambda k, b, r: events.append((k, b.hash, r.segment.node_id, r.tier)),
        **kw,
    )
    return m, clock, events


def put(m, writer, keys, size=4 * KB):
    placed, _ = m.put_start(writer, keys, size)
    m.put_end([b.hash for b in placed])
    return placed


def test_local_first_then_free_ratio():
    m, _, _ = make()
    m.mount("a", "a:1", 0, 100 * KB)
    m.mount("b", "b:1", 0, 100 * KB)
    m.mount("c", "c:1", 0, 200 * KB)
    assert put(m, "b", [h(1)])[0].segment.node_id == "b"
    assert put(m, "a", [h(50)])[0].segment.node_id == "a"
    # a stranger's put goes to the segment with the highest free ratio
    assert put(m, "x", [h(2)])[0].segment.node_id == "c"
    put(m, "x", [h(i) for i in range(3, 30)])
    ratios = sorted(round(s.free_ratio, 2) for s in m.segments.values())
    assert ratios[-1] - ratios[0] < 0.1


def test_put_timeout_reclaims_and_put_end_reports_failure():
    m, clock, _ = make(put_timeout_s=5)
    m.mount("a", "a:1", 0, 64 * KB)
    placed, _ = m.put_start("a", [h(1), h(2)], 4 * KB)
    assert m.used == 8 * KB and m.present([h(1)]) == [False]
    clock.t += 6
    assert m.reclaim_abandoned() == 2 and m.used == 0
    done, failed = m.put_end_detail([h(1), h(2)])
    assert done == [] and failed == [h(1), h(2)]


class CountingBlocks(dict):
    """A block table that counts full scans (``values()``)."""

    scans = 0

    def values(self):
        CountingBlocks.scans += 1
        return super().values()


def test_put_start_does_not_scan_every_block_until_a_put_can_have_run_out():
    """A put used to look through every block for abandoned puts (O(blocks) per put, the
    remote put slowing down as the store filled); now only once a deadline has passed,
    and abandoned puts are still reclaimed then."""
    m, clock, _ = make(put_timeout_s=5)
    m.mount("a", "a:1", 0, 4096 * KB)
    put(m, "a", [h(i) for i in range(200)])
    from collections import OrderedDict

    class Blocks(CountingBlocks, OrderedDict):
        pass

    m.blocks = Blocks(m.blocks)
    CountingBlocks.scans = 0
    for i in range(200, 300):
        put(m, "a", [h(i)])
    m.put_start("a", [h(1000)], 4 * KB)  # abandoned
    assert CountingBlocks.scans == 0
    clock.t += 6
    assert m.reclaim_abandoned() == 1 and m.present([h(1000)]) == [False]
    assert CountingBlocks.scans == 1
    placed, _ = m.put_start("a", [h(1001)], 4 * KB)  # the next deadline is 5 s away
    assert placed and CountingBlocks.scans == 1


def test_lease_and_inflight_block_eviction_pins_go_last():
    m, clock, _ = make(lease_s=10)
    m.mount("a", "a:1", 0, 40 * KB)  # 10 blocks
    put(m, "a", [h(i) for i in range(9)])
    m.pin([h(0)])
    m.get_replicas([h(1)])  # leased
    clock.t += 1
    assert m.over_high(4 * KB)
    # this put would pass the high watermark: eviction down to the low one (8 blocks) first
    m.put_start("a", [h(100)], 4 * KB)  # stays in flight (pending)
    left = {b.hash for b in m.blocks.values()}
    assert {h(0), h(1), h(100)} <= left  # pinned, leased and pending survive
    assert h(2) not in left  # oldest unpinned went first
    clock.t += 11  # lease over
    m.evict(target_used=0)
    assert set(m.blocks) == {h(100)}  # the pin went last, the pending block stays


def test_prefix_exists_remove():
    m, _, _ = make()
    m.mount("a", "a:1", 0, 64 * KB)
    put(m, "a", [h(1), h(2), h(4)])
    assert len(m.prefix([h(1), h(2), h(3), h(4)])) == 2
    assert m.present([h(1), h(3), h(4)]) == [True, False, True]
    assert m.remove([h(2), h(9)]) == 1
    assert len(m.prefix([h(1), h(2)])) == 1


def test_hot_block_gets_replicas_up_to_cap_and_reader_prefers_own():
    m, clock, ev = make(hot_reads=3, max_replicas=2)
    for n in "abc":
        m.mount(n, f"{n}:1", 0, 64 * KB, grpc_address=f"{n}:g")
    put(m, "a", [h(1)])
    plans = []
    for _ in range(5):
        got, _ = m.get_replicas([h(1)], reader="z")
        plans += m.plan_replications(b for b, _ in got)
        clock.t += 0.01
    assert len(plans) == 1 and plans[0].replica.segment.node_id != "a"
    m.finish_plan(plans[0], ok=True)
    blk = m.blocks[h(1)]
    assert len(blk.complete(DRAM)) == 2
    assert ev[-1][0] == "stored"
    target = plans[0].replica.segment.node_id
    assert m.get_replicas([h(1)], reader=target)[0][0][1].segment.node_id == target
    # at the cap: no further replica however hot
    for _ in range(10):
        got, _ = m.get_replicas([h(1)], reader="z")
        assert not m.plan_replications(b for b, _ in got)
    # reads from strangers spread over both replicas (least loaded)
    used = {m.get_replicas([h(1)], reader="z")[0][0][1].segment.node_id for _ in range(4)}
    assert len(used) == 2


def test_spill_then_promote_and_failed_promote_is_a_miss():
    m, clock, ev = make()
    m.mount("a", "a:1", 0, 40 * KB, grpc_address="a:g", ssd_bytes=1 << 20)
    put(m, "a", [h(i) for i in range(10)])
    plans = m.plan_eviction(int(m.low * m.capacity))
    assert plans and all(p.replica.tier == DRAM for p in plans)
    for p in plans:
        m.finish_spill(p, ok=True)
    assert m.used <= int(m.low * m.capacity)
    spilled = plans[0].block.hash
    assert m.blocks[spilled].complete(DRAM) == [] and m.blocks[spilled].complete(SSD)
    assert m.present([spilled]) == [True]  # SSD counts for exists
    assert m.get_replicas([spilled])[0] == []  # but is not readable until promoted
    (pp,) = m.plan_promotions([m.blocks[spilled]])
    m.finish_plan(pp, ok=True)
    assert len(m.get_replicas([spilled])[0]) == 1
    # a corrupt/missing file: the promote fails and the block is gone
    other = plans[1].block.hash
    (pp,) = m.plan_promotions([m.blocks[other]])
    m.finish_plan(pp, ok=False)
    assert other not in m.blocks
    assert ("removed", other, "a", SSD) in ev


def test_node_loss_drops_replicas_and_fails_inflight_puts():
    m, _, _ = make()
    m.mount("a", "a:1", 0, 64 * KB)
    m.mount("b", "b:1", 0, 64 * KB)
    put(m, "a", [h(1)])
    put(m, "b", [h(2)])
    m.put_start("b", [h(3)], 4 * KB)
    assert m.unmount_node("b") == (1, 2)
    assert set(m.blocks) == {h(1)}
    assert m.put_end_detail([h(3)]) == ([], [h(3)])


def test_report_rebuilds_allocator_and_rejects_overlaps():
    m, _, _ = make()
    m.mount("a", "a:1", 0, 64 * KB)
    ok, bad = m.report(
        "a",
        0,
        [
            (h(1), 0, 4 * KB, DRAM),
            (h(2), 8 * KB, 4 * KB, DRAM),
            (h(3), 10 * KB, 4 * KB, DRAM),  # overlaps h(2)
            (h(4), 0, 4 * KB, SSD),
        ],
    )
    assert (ok, bad) == (3, 1)
    seg = m.segments["a/0"]
    assert seg.used == 8 * KB
    offs = {seg.allocate(4 * KB) for _ in range(2)}
    assert offs == {4 * KB, 12 * KB}  # the gap, then past the end
    assert m.blocks[h(1)].state is BlockState.COMPLETE


def test_generic_sizes():
    m, _, _ = make()
    m.mount("a", "a:1", 0, 64 * KB)
    placed, _ = m.put_start("a", [b"k", b"x" * 256], [100, 5000])
    assert [b.size for b in placed] == [100, 5000]


def test_local_put_slots_reserve_commit_release():
    """PutLocal: slots reserved in the writer's own segment count as used, are never
    evicted, become COMPLETE blocks only at commit, survive a re-report and are freed
    when the lender re-mounts."""
    from kvmesh.services.store_master.metadata import BlockState, StoreMetadata

    m = StoreMetadata(high_watermark=0.9, low_watermark=0.8)
    m.mount("w", "w:1", 0, 16 * 4096)
    m.mount("x", "x:1", 0, 16 * 4096)
    assert m.reserve("nobody", 0, 4096, 2) == []  # the writer lends nothing
    slots = m.reserve("w", 0, 4096, 2, spare=2)
    assert len(slots) == 4 and m.segments["w/0"].used == 4 * 4096
    assert not m.present([b"k1"])[0]  # nothing visible yet
    st = m.commit_local(
        "w", 0, [(b"k1", slots[0], 4096), (b"k2", 999, 4096), (b"k3", slots[1], 8192)]
    )
    assert st == [1, 0, 0]  # unknown slot / wrong size
    blk = m.blocks[b"k1"]
    assert blk.visible and blk.replicas[0].state is BlockState.COMPLETE
    assert blk.segment.segment_id == "w/0" and blk.offset == slots[0]
    assert m.commit_local("w", 0, [(b"k1", slots[1], 4096)]) == [2]  # present: kept
    assert m.release_reserved("w", 0, [(slots[1], 4096), (12345, 4096)]) == 1
    assert m.commit_local("w", 0, [(b"k9", slots[1], 4096)]) == [0]  # released
    # eviction never takes reserved slots; a re-report keeps them allocated
    got, _ = m.get_replicas([b"k1"])
    assert got
    m.report("w", 0, [(b"k1", slots[0], 4096, "dram")])
    assert m.segments["w/0"].reserved == {slots[2]: 4096, slots[3]: 4096}
    again = m.reserve("w", 0, 4096, 1)
    assert again and again[0] not in (slots[0], slots[2], slots[3])
    # the lender re-mounts: its reservations are freed, its blocks stay
    m.mount("w", "w:1", 0, 16 * 4096)
    assert m.segments["w/0"].reserved == {} and m.segments["w/0"].used == 4096
    assert m.present([b"k1"]) == [True]


def test_watch_blocks_misses_nothing_stored_while_the_snapshot_is_sent():
    """WatchBlocks suspends at every snapshot event it sends; a block stored meanwhile must
    still reach the subscriber (it was lost when the stream subscribed only after sending
    the whole snapshot)."""
    import asyncio
    from types import SimpleNamespace

    from kvmesh.protos import kvmesh_pb2 as pb
    from kvmesh.services.store_master.events import EventBus
    from kvmesh.services.store_master.model import Block, BlockState, Replica, Segment
    from kvmesh.services.store_master.server import StoreMasterServicer

    seg = Segment("s0", "node-a", "127.0.0.1:1", 1, 1 << 20)

    def block(i: int) -> tuple[Block, Replica]:
        rep = Replica(seg, i * 4096, state=BlockState.COMPLETE)
        return Block(bytes([i]) * 32, 4096, [rep]), rep

    a, b = block(1), block(2)
    host = SimpleNamespace(meta=SimpleNamespace(blocks={a[0].hash: a[0], b[0].hash: b[0]}),
                           bus=EventBus())  # fmt: skip

    async def main() -> list[bytes]:
        stream = StoreMasterServicer.WatchBlocks(
            host, pb.WatchBlocksRequest(node_id="", snapshot=True), None
        )
        got = [(await stream.__anext__()).hash]  # the stream is suspended mid-snapshot
        c = block(3)
        host.meta.blocks[c[0].hash] = c[0]
        host.bus.publish("stored", *c)
        for _ in range(2):
            got.append((await asyncio.wait_for(stream.__anext__(), 2)).hash)
        await stream.aclose()
        assert not host.bus.subs  # closing the stream unsubscribes
        return got

    assert asyncio.run(main()) == [a[0].hash, b[0].hash, bytes([3]) * 32]


def test_remote_slots_reserve_commit_expire_and_survive_a_remount():
    """Slots held for a writer without a segment: nothing is visible until a commit;
    a commit of a slot not held (never reserved, another size, another segment) is 0;
    a present key leaves the slot held; a re-mount of the segment keeps them; past
    ``put_timeout_s`` they are freed, and a late commit stores nothing."""
    m, clock, events = make(put_timeout_s=5)
    m.mount("n", "n:1", 7, 256 * KB)
    seg, offs, tok = m.reserve_remote("client", 4 * KB, 2, 1)
    assert seg is not None and seg.node_id == "n" and len(offs) == 3 and tok != 0
    assert m.used == 12 * KB and m.present([h(1)]) == [False] and events == []
    status, tok2, new = m.commit_remote("n", 7, [(h(1), offs[0], 4 * KB, tok)], refill=2)
    assert status == [1] and len(new) == 2 and m.present([h(1)]) == [True]
    assert tok2 not in (0, tok)  # the refill is a reservation of its own
    assert events == [("stored", h(1), "n", DRAM)]
    assert m.blocks[h(1)].offset == offs[0] and m.used == 20 * KB  # 3 slots + 2 refills
    # not held: an unknown offset, the wrong size, another segment, a local slot
    local = m.reserve("n", 7, 4 * KB, 1)
    assert m.commit_remote("n", 7, [(h(2), 200 * KB, 4 * KB, tok)])[0] == [0]
    assert m.commit_remote("n", 7, [(h(2), offs[1], 8 * KB, tok)])[0] == [0]
    assert m.commit_remote("other", 7, [(h(2), offs[1], 4 * KB, tok)])[0] == [0]
    assert m.commit_remote("n", 7, [(h(2), local[0], 4 * KB, tok)])[0] == [0]
    assert m.present([h(2)]) == [False]
    # a present key: status 2, the slot stays held (and committable later)
    assert m.commit_remote("n", 7, [(h(1), offs[1], 4 * KB, tok)])[0] == [2]
    # a re-mount frees the lender's own reservations, not the remote writer's
    m.mount("n", "n:1", 7, 256 * KB)
    assert local[0] not in seg.reserved and offs[1] in seg.reserved
    assert m.commit_remote("n", 7, [(h(3), offs[1], 4 * KB, tok)])[0] == [1]
    before = m.used
    clock.t += 6
    m.reclaim_abandoned()
    assert m.used == before - 3 * 4 * KB  # offs[2] and the two refills expired
    assert m.remote_slots == {} and seg.reserved == {}
    assert m.commit_remote("n", 7, [(h(4), offs[2], 4 * KB, tok)])[0] == [0]
    assert m.present([h(1), h(3), h(4)]) == [True, True, False]
    # nowhere to put it: nothing reserved
    assert m.reserve_remote("client", 512 * KB, 1) == (None, [], 0)


def test_an_expired_slot_given_to_another_writer_is_not_committed_by_the_first():
    """Review finding 1 (issue 13): writer A's slot expires, the allocator gives the same
    offset to writer B; A's late commit (its token) is 0 and stores nothing, B's commit
    stores B's key there, and a commit without the token (0) never matches."""
    m, clock, _ = make(put_timeout_s=5)
    m.mount("n", "n:1", 7, 4 * KB)  # room for one slot: B must get A's offset
    _, (off_a,), tok_a = m.reserve_remote("a", 4 * KB, 1)
    clock.t += 6
    _, (off_b,), tok_b = m.reserve_remote("b", 4 * KB, 1)
    assert off_b == off_a and tok_b != tok_a
    assert m.commit_remote("n", 7, [(h(1), off_a, 4 * KB, tok_a)])[0] == [0]
    assert m.commit_remote("n", 7, [(h(1), off_a, 4 * KB, 0)])[0] == [0]
    assert m.present([h(1)]) == [False]
    assert m.commit_remote("n", 7, [(h(2), off_b, 4 * KB, tok_b)])[0] == [1]
    assert m.blocks[h(2)].offset == off_b


def test_remote_slots_of_an_unmounted_segment_stay_quarantined_until_their_deadline():
    """Review finding 2 (issue 13): the segment is unmounted (membership leave, an etcd
    restart) while a remote writer holds slots in it and may still be writing there; a
    re-mount of the same memory (node, region, address) reserves those ranges again, so
    no put or other writer's slot lands there before their deadline; they are never
    committed (even with the right token) and are freed at the deadline. Memory at
    another address is a fresh start."""
    m, clock, _ = make(put_timeout_s=5)
    m.mount("n", "n:1", 7, 64 * KB)
    _, offs, tok = m.reserve_remote("a", 4 * KB, 2)
    assert m.unmount_segment("n/7") == 0 and m.remote_slots == {}
    clock.t += 1
    seg = m.mount("n", "n:1", 7, 64 * KB)
    assert seg.reserved == {o: 4 * KB for o in offs} and seg.used == 8 * KB
    placed, _ = m.put_start("b", [h(1), h(2)], 4 * KB)
    _, more, _ = m.reserve_remote("c", 4 * KB, 1)
    taken = {b.offset for b in placed} | set(more)
    assert len(taken) == 3 and not taken & set(offs)
    assert m.commit_remote("n", 7, [(h(3), offs[0], 4 * KB, tok)])[0] == [0]
    assert m.commit_local("n", 7, [(h(3), offs[0], 4 * KB)]) == [0]
    assert m.present([h(3)]) == [False]
    clock.t += 5  # past the deadline: freed
    m.reclaim_abandoned()
    assert all(o not in seg.reserved for o in offs) and m.quarantine == {}
    # unmounted again past the deadline: nothing kept; another address: nothing kept
    _, offs2, _ = m.reserve_remote("a", 4 * KB, 1)
    m.unmount_segment("n/7")
    assert m.mount("n", "n:2", 7, 64 * KB).reserved == {}
    m.unmount_segment("n/7")
    clock.t += 6
    assert m.mount("n", "n:1", 7, 64 * KB).reserved == {}


def test_the_lender_cannot_commit_or_release_a_slot_held_for_a_remote_writer():
    """Review finding 7 (issue 13): the lender's PUT_LOCAL (commit_local /
    release_reserved) names an offset that is a remote writer's slot: 0 / ignored, the
    slot stays the writer's and commits under its token."""
    m, _, _ = make(put_timeout_s=5)
    m.mount("n", "n:1", 7, 16 * KB)
    _, (off,), tok = m.reserve_remote("n", 4 * KB, 1)
    assert m.commit_local("n", 7, [(h(1), off, 4 * KB)]) == [0]
    assert m.release_reserved("n", 7, [(off, 4 * KB)]) == 0
    assert m.segments["n/7"].reserved == {off: 4 * KB} and m.present([h(1)]) == [False]
    assert m.commit_remote("n", 7, [(h(2), off, 4 * KB, tok)])[0] == [1]


def test_release_remote_frees_only_slots_held_under_their_token_and_size():
    """PUT_RELEASE's release_remote: a committed slot is the key's now (0 freed), a slot
    whose commit found the key present is still the writer's (1 freed), a wrong size or
    a token of 0 frees nothing (even for a slot somehow held under token 0)."""
    m, _, _ = make(put_timeout_s=5)
    m.mount("n", "n:1", 7, 64 * KB)
    seg, offs, tok = m.reserve_remote("w", 4 * KB, 4)
    assert seg is not None and len(offs) == 4
    assert m.commit_remote("n", 7, [(h(1), offs[0], 4 * KB, tok)])[0] == [1]
    assert m.release_remote("n", 7, 4 * KB, [(offs[0], tok)]) == 0
    assert m.present([h(1)]) == [True] and m.blocks[h(1)].offset == offs[0]
    assert m.commit_remote("n", 7, [(h(1), offs[1], 4 * KB, tok)])[0] == [2]
    used = m.used
    assert m.release_remote("n", 7, 4 * KB, [(offs[1], tok)]) == 1
    assert m.used == used - 4 * KB and offs[1] not in seg.reserved
    assert m.release_remote("n", 7, 8 * KB, [(offs[2], tok)]) == 0  # the wrong size
    assert m.release_remote("n", 7, 4 * KB, [(offs[2], 0)]) == 0  # no token
    assert m.release_remote("other", 7, 4 * KB, [(offs[2], tok)]) == 0  # no such segment
    m.remote_slots[("n/7", offs[3])] = (m.remote_slots[("n/7", offs[3])][0], 0)
    assert m.release_remote("n", 7, 4 * KB, [(offs[3], 0)]) == 0  # token 0 never matches
    assert offs[2] in seg.reserved and offs[3] in seg.reserved and m.used == used - 4 * KB
    assert m.release_remote("n", 7, 4 * KB, [(offs[2], tok)]) == 1


def test_watch_blocks_coalesces_what_is_published_together_in_order():
    """Events published within EVENT_COALESCE_S of each other reach a subscriber as one
    message (the first event, the rest in ``more``, in order); a second subscriber gets
    the same events, unaltered by the first one's batching; a stream cut while it
    gathers sends the event it woke for (the cut drops the queued rest: the subscriber
    re-subscribes with a snapshot), then ends."""
    import asyncio
    from types import SimpleNamespace

    from kvmesh.protos import kvmesh_pb2 as pb
    from kvmesh.services.store_master.events import EventBus
    from kvmesh.services.store_master.model import Block, BlockState, Replica, Segment
    from kvmesh.services.store_master.server import StoreMasterServicer

    seg = Segment("s0", "node-a", "127.0.0.1:1", 1, 1 << 20)
    blocks = [Block(bytes([i]) * 16, 4096, [Replica(seg, i * 4096, state=BlockState.COMPLETE)])
              for i in range(1, 6)]  # fmt: skip
    host = SimpleNamespace(meta=SimpleNamespace(blocks={}), bus=EventBus())

    async def main():
        req = pb.WatchBlocksRequest(node_id="", coalesce=True)
        s1 = StoreMasterServicer.WatchBlocks(host, req, None)
        s2 = StoreMasterServicer.WatchBlocks(host, req, None)
        first = [asyncio.ensure_future(s.__anext__()) for s in (s1, s2)]
        await asyncio.sleep(0.01)  # both subscribed and waiting
        for b in blocks[:3]:
            host.bus.publish("stored", b, b.replicas[0])
        got = await asyncio.gather(*first)
        host.bus.publish("removed", blocks[3], blocks[3].replicas[0])
        q1 = host.bus.subs[0][1]
        nxt = asyncio.ensure_future(s1.__anext__())
        await asyncio.sleep(0)
        host.bus.publish("stored", blocks[4], blocks[4].replicas[0])
        host.bus.cut("", q1)  # cut while it gathers: what it gathered is still sent
        last = await nxt
        ended = False
        try:
            await s1.__anext__()
        except StopAsyncIteration:
            ended = True
        await s2.aclose()
        return got, last, ended

    got, last, ended = asyncio.run(main())
    for msg in got:
        seq = [(e.type, bytes(e.hash)[0], e.seq) for e in (msg, *msg.more)]
        assert seq == [("stored", 1, 1), ("stored", 2, 2), ("stored", 3, 3)]
        assert all(not e.more for e in msg.more)
    assert [(e.type, bytes(e.hash)[0]) for e in (last, *last.more)] == [("removed", 4)]
    assert ended


def test_watch_blocks_coalesces_only_for_a_subscriber_that_asks():
    """Review finding 8 (issue 13): a subscriber that does not set ``coalesce`` (one
    built before ``BlockEvent.more``, which reads only the head of a message) gets every
    event as a message of its own, none in ``more``; one that asks gets a lone event at
    once, without the gathering wait, when nothing else is pending."""
    import asyncio
    from types import SimpleNamespace

    from kvmesh.protos import kvmesh_pb2 as pb
    from kvmesh.services.store_master import events
    from kvmesh.services.store_master.events import EventBus
    from kvmesh.services.store_master.model import Block, BlockState, Replica, Segment
    from kvmesh.services.store_master.server import StoreMasterServicer

    seg = Segment("s0", "node-a", "127.0.0.1:1", 1, 1 << 20)
    blocks = [Block(bytes([i]) * 16, 4096, [Replica(seg, i * 4096, state=BlockState.COMPLETE)])
              for i in range(1, 4)]  # fmt: skip
    host = SimpleNamespace(meta=SimpleNamespace(blocks={}), bus=EventBus())

    async def main():
        old = StoreMasterServicer.WatchBlocks(host, pb.WatchBlocksRequest(), None)
        new = StoreMasterServicer.WatchBlocks(host, pb.WatchBlocksRequest(coalesce=True), None)
        first = asyncio.ensure_future(old.__anext__())
        lone = asyncio.ensure_future(new.__anext__())
        await asyncio.sleep(0.01)  # both subscribed and waiting
        for b in blocks:
            host.bus.publish("stored", b, b.replicas[0])
        async with asyncio.timeout(30):  # coalesced for it: the next two never come
            got = [await first] + [await old.__anext__() for _ in range(2)]
        # the coalescing one: drain what was published together, then a lone event
        head = await lone
        assert len(head.more) == 2
        # a lone event after a quiet spell goes at once, even for a subscriber whose
        # window (600 s) would outlast the test's bound
        cap, events.EVENT_COALESCE_MAX_MS = events.EVENT_COALESCE_MAX_MS, 600_000
        try:
            req = pb.WatchBlocksRequest(coalesce=True, coalesce_ms=600_000)
            slow = StoreMasterServicer.WatchBlocks(host, req, None)
            nxt = asyncio.ensure_future(slow.__anext__())
            await asyncio.sleep(0.01)  # subscribed and waiting
            host.bus.publish("removed", blocks[0], blocks[0].replicas[0])
            async with asyncio.timeout(30):
                alone = await nxt
        finally:
            events.EVENT_COALESCE_MAX_MS = cap
        await slow.aclose()
        await old.aclose()
        await new.aclose()
        return got, alone

    got, alone = asyncio.run(main())
    assert [(e.type, bytes(e.hash)[0], len(e.more)) for e in got] == [
        ("stored", 1, 0),
        ("stored", 2, 0),
        ("stored", 3, 0),
    ]
    assert (alone.type, bytes(alone.hash)[0], len(alone.more)) == ("removed", 1, 0)


def test_every_replica_has_its_own_generation_and_a_slot_commit_the_writers():
    """Issue 13, read ahead: a replica committed into a remote slot carries
    ``wire.slot_gen(token, offset)`` (its writer knows it); a key removed and put again
    into the same slot is a new replica with another generation; other replicas get a
    fresh one each."""
    from kvmesh.services.store_master import wire

    m, _, _ = make()
    m.mount("n", "n:1", 7, 256 * KB)
    _, offs, tok = m.reserve_remote("client", 4 * KB, 1)
    assert m.commit_remote("n", 7, [(h(1), offs[0], 4 * KB, tok)])[0] == [1]
    first = m.blocks[h(1)].replicas[0]
    assert first.gen == wire.slot_gen(tok, offs[0]) and first.gen != 0
    assert m.remove([h(1)]) == 1
    _, offs2, tok2 = m.reserve_remote("client", 4 * KB, 1)
    assert offs2 == offs  # the same place again
    assert m.commit_remote("n", 7, [(h(1), offs2[0], 4 * KB, tok2)])[0] == [1]
    again = m.blocks[h(1)].replicas[0]
    assert again.offset == first.offset and again.gen != first.gen
    put(m, "n", [h(2), h(3)])
    gens = {m.blocks[k].replicas[0].gen for k in (h(2), h(3))}
    assert len(gens) == 2 and 0 not in gens and again.gen not in gens
    # distinct (token, offset) pairs give distinct generations, never 0
    seen = {wire.slot_gen(t, o) for t in (1, 2, 3, 1 << 63) for o in range(0, 64 * KB, 4 * KB)}
    assert len(seen) == 4 * 16 and 0 not in seen


def test_watch_blocks_coalesces_a_run_of_lone_events():
    """Issue 13: events published one at a time (a run of single puts) go out one
    message per spell: the first at once, the next lone one, within EVENT_COALESCE_S of
    that message, waits for the spell's end and takes what was published meanwhile."""
    import asyncio
    from types import SimpleNamespace

    from kvmesh.protos import kvmesh_pb2 as pb
    from kvmesh.services.store_master import events
    from kvmesh.services.store_master.events import EventBus
    from kvmesh.services.store_master.model import Block, BlockState, Replica, Segment
    from kvmesh.services.store_master.server import StoreMasterServicer

    seg = Segment("s0", "node-a", "127.0.0.1:1", 1, 1 << 20)
    blocks = [Block(bytes([i]) * 16, 4096, [Replica(seg, i * 4096, state=BlockState.COMPLETE)])
              for i in range(1, 4)]  # fmt: skip
    host = SimpleNamespace(meta=SimpleNamespace(blocks={}), bus=EventBus())
    frozen = time.monotonic()
    events._clock = lambda: frozen  # no time passes between the messages

    async def main():
        s = StoreMasterServicer.WatchBlocks(host, pb.WatchBlocksRequest(coalesce=True), None)
        nxt = asyncio.ensure_future(s.__anext__())
        await asyncio.sleep(0.01)  # subscribed and waiting
        host.bus.publish("stored", blocks[0], blocks[0].replicas[0])
        async with asyncio.timeout(30):
            first = await nxt
        nxt = asyncio.ensure_future(s.__anext__())
        host.bus.publish("stored", blocks[1], blocks[1].replicas[0])
        await asyncio.sleep(0)  # the stream takes it, alone, and waits
        host.bus.publish("stored", blocks[2], blocks[2].replicas[0])
        async with asyncio.timeout(30):
            second = await nxt
        await s.aclose()
        return first, second

    try:
        first, second = asyncio.run(main())
    finally:
        events._clock = time.monotonic
    assert [bytes(e.hash)[0] for e in (first, *first.more)] == [1]
    assert [bytes(e.hash)[0] for e in (second, *second.more)] == [2, 3]


def test_watch_blocks_holds_events_as_long_as_the_subscriber_asks():
    """Issue 13: ``coalesce_ms`` is the subscriber's own window (a store-node asks for
    more lag than the master's 2 ms default: its index is read only after a master
    restart). A lone event published 30 ms after another waits for it within a 500 ms
    window, and goes alone within the default one."""
    import asyncio
    from types import SimpleNamespace

    from kvmesh.protos import kvmesh_pb2 as pb
    from kvmesh.services.store_master import events
    from kvmesh.services.store_master.events import EventBus
    from kvmesh.services.store_master.model import Block, BlockState, Replica, Segment
    from kvmesh.services.store_master.server import StoreMasterServicer

    seg = Segment("s0", "node-a", "127.0.0.1:1", 1, 1 << 20)
    blocks = [Block(bytes([i]) * 16, 4096, [Replica(seg, i * 4096, state=BlockState.COMPLETE)])
              for i in range(1, 4)]  # fmt: skip
    frozen = time.monotonic()
    events._clock = lambda: frozen  # every lone event after the first is inside the window

    async def second_message(coalesce_ms: int) -> list[int]:
        host = SimpleNamespace(meta=SimpleNamespace(blocks={}), bus=EventBus())
        req = pb.WatchBlocksRequest(coalesce=True, coalesce_ms=coalesce_ms)
        s = StoreMasterServicer.WatchBlocks(host, req, None)
        nxt = asyncio.ensure_future(s.__anext__())
        await asyncio.sleep(0.01)  # subscribed and waiting
        host.bus.publish("stored", blocks[0], blocks[0].replicas[0])
        async with asyncio.timeout(30):
            await nxt
        nxt = asyncio.ensure_future(s.__anext__())
        host.bus.publish("stored", blocks[1], blocks[1].replicas[0])
        await asyncio.sleep(0.03)
        host.bus.publish("stored", blocks[2], blocks[2].replicas[0])
        async with asyncio.timeout(30):
            second = await nxt
        await s.aclose()
        return [bytes(e.hash)[0] for e in (second, *second.more)]

    try:
        assert asyncio.run(second_message(500)) == [2, 3]
        assert asyncio.run(second_message(0)) == [2]  # the master's 2 ms
    finally:
        events._clock = time.monotonic


def test_watch_blocks_sends_full_batches_without_waiting_the_window():
    """Review of issue 13: the window delays events, it caps no rate. A subscriber whose
    window outlasts the test's bound still gets each full batch (1 + EVENT_BATCH events)
    at once; only the partial rest waits to fill."""
    import asyncio
    from types import SimpleNamespace

    from kvmesh.protos import kvmesh_pb2 as pb
    from kvmesh.services.store_master import events
    from kvmesh.services.store_master.events import EVENT_BATCH, EventBus
    from kvmesh.services.store_master.model import Block, BlockState, Replica, Segment
    from kvmesh.services.store_master.server import StoreMasterServicer

    seg = Segment("s0", "node-a", "127.0.0.1:1", 1, 1 << 30)
    n = 2 * (EVENT_BATCH + 1) + 3
    blocks = [Block(i.to_bytes(16, "big"), 4096, [Replica(seg, i * 4096, state=BlockState.COMPLETE)])
              for i in range(n)]  # fmt: skip
    host = SimpleNamespace(meta=SimpleNamespace(blocks={}), bus=EventBus())

    async def main():
        req = pb.WatchBlocksRequest(coalesce=True, coalesce_ms=600_000)
        s = StoreMasterServicer.WatchBlocks(host, req, None)
        nxt = asyncio.ensure_future(s.__anext__())
        await asyncio.sleep(0.01)  # subscribed and waiting
        for b in blocks:
            host.bus.publish("stored", b, b.replicas[0])
        async with asyncio.timeout(30):
            msgs = [await nxt, await s.__anext__()]
        await s.aclose()
        return msgs

    cap, events.EVENT_COALESCE_MAX_MS = events.EVENT_COALESCE_MAX_MS, 600_000
    try:
        msgs = asyncio.run(main())
    finally:
        events.EVENT_COALESCE_MAX_MS = cap
    got = [int.from_bytes(e.hash, "big") for m in msgs for e in (m, *m.more)]
    assert [1 + len(m.more) for m in msgs] == [EVENT_BATCH + 1] * 2
    assert got == list(range(2 * (EVENT_BATCH + 1)))  # in order
