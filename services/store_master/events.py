"""Block events: every replica the store-master stores or removes, published to the
``WatchBlocks`` streams of the store-nodes (their re-report index), the conductors (their
prefix index) and tools. A subscriber's queue holds up to ``EVENT_QUEUE`` events; one that
falls further behind is cut off and re-subscribes with a snapshot."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.store_master.metadata import Block, Replica

EVENT_QUEUE = 65536
# WatchBlocks gathers the events published this long after the first one it wakes for
# into one stream message (``BlockEvent.more``): one message per put cost a store-node
# and this master a gRPC send and receive each, on the cores the puts run on. A lone
# event goes out at once after a quiet spell; within this long of the last message it
# waits for the rest of the spell, so a run of single puts (each one event, published
# one at a time) is at most one message per spell too: each message a put's write met
# on the store-node delayed it (issue 13: 4 KiB put commit ~30% faster). This is the
# default window; a subscriber may ask for its own, up to EVENT_COALESCE_MAX_MS
# (``coalesce_ms``: a store-node asks for 10 ms). A full batch goes at once.
EVENT_COALESCE_S = 0.002
EVENT_COALESCE_MAX_MS = 100  # the most lag a subscriber may ask for (coalesce_ms)
_clock = time.monotonic  # the spells' clock (a test's to set)
EVENT_BATCH = 1024  # most events in one message


class EventBus:
    """Fans block events out to ``WatchBlocks`` streams; a subscriber that falls
    ``EVENT_QUEUE`` events behind is cut off (it re-subscribes with a snapshot)."""

    def __init__(self) -> None:
        self.master_id = uuid.uuid4().hex[:12]
        self.seq = 0
        self.subs: list[tuple[str, asyncio.Queue]] = []

    def event(self, kind: str, blk: Block, rep: Replica) -> pb.BlockEvent:
        """The event of ``rep`` of ``blk``, numbered with the bus's current sequence."""
        s = rep.segment
        return pb.BlockEvent(
            seq=self.seq,
            type=kind,
            hash=blk.hash,
            node_id=s.node_id,
            tier=rep.tier,
            offset=rep.offset,
            size=blk.size,
            region_id=s.region_id,
            master_id=self.master_id,
        )

    def publish(self, kind: str, blk: Block, rep: Replica) -> None:
        self.seq += 1
        if not self.subs:
            return
        ev = self.event(kind, blk, rep)
        for node, q in list(self.subs):
            if node and node != rep.segment.node_id:
                continue
            try:
                q.put_nowait(ev)
            except asyncio.QueueFull:
                self.cut(node, q)

    def cut(self, node: str, q: asyncio.Queue) -> None:
        """Ends a subscriber's stream (it sees None next)."""
        if (node, q) in self.subs:
            self.subs.remove((node, q))
        while not q.empty():
            q.get_nowait()
        q.put_nowait(None)


async def watch(
    bus: EventBus, blocks: dict[bytes, Block], req: pb.WatchBlocksRequest
) -> AsyncGenerator[pb.BlockEvent, None]:
    """The ``WatchBlocks`` stream of one subscriber: a snapshot of ``blocks`` when asked,
    then every event ``bus`` publishes for ``req.node_id`` (all of them for ""), coalesced
    into fewer messages when the subscriber reads ``BlockEvent.more``."""
    node = req.node_id
    # opt-in: older subscribers read only the head of a message and would drop ``more``
    window = min(req.coalesce_ms, EVENT_COALESCE_MAX_MS) / 1000 or EVENT_COALESCE_S
    coalesce = req.coalesce and window > 0
    # Subscribe, and take the snapshot, with no await in between; only then send the
    # snapshot. Sending suspends at every yield (the stream's flow control): had the
    # subscription waited until the snapshot was sent, a block stored meanwhile would
    # be in neither. An event for a snapshotted block arrives after it, in order.
    snapshot = (
        [
            bus.event("stored", b, r)
            for b in list(blocks.values())
            for r in b.complete(None)
            if not node or r.segment.node_id == node
        ]
        if req.snapshot
        else []
    )
    # room for what happens while the snapshot is sent, on top of the usual lag: a
    # big snapshot must not get its subscriber cut (and resent) before it is through
    q: asyncio.Queue = asyncio.Queue(maxsize=EVENT_QUEUE + len(snapshot))
    bus.subs.append((node, q))
    last = -float("inf")  # when the last message went out (coalescing)
    try:
        for ev in snapshot:
            yield ev
        while True:
            ev = await q.get()
            if ev is None:
                return
            # nothing else pending after a quiet spell: send it now
            wait = window if not q.empty() else last + window - _clock()
            if coalesce and wait > 0:
                # a full batch goes at once: the window delays events, it caps no rate
                if q.qsize() < EVENT_BATCH:
                    await asyncio.sleep(wait)  # publishing meanwhile wakes nobody
                more: list[pb.BlockEvent] = []
                cut = False
                while not q.empty() and len(more) < EVENT_BATCH:
                    nxt = q.get_nowait()
                    if nxt is None:
                        cut = True
                        break
                    more.append(nxt)
                if more:  # events are shared by subscribers: batch in a copy
                    head = pb.BlockEvent()
                    head.CopyFrom(ev)
                    head.more.extend(more)
                    ev = head
                last = _clock()
                yield ev
                if cut:
                    return
                continue
            last = _clock()
            yield ev
    finally:
        if (node, q) in bus.subs:
            bus.subs.remove((node, q))
