"""What a model node tells the conductor besides its etcd registration: a **WatchEvents**
stream per subscriber, first a snapshot of the node's cached block hashes, then, every
interval, the blocks stored and removed since, and a load report with the prefill and
decode timings observed since (the online refit's data). The start-up profile sent with
the registration is measured in ``kvmesh.services.node_profile``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.protos import kvmesh_pb2 as pb

MAX_PENDING = 4096


@dataclass(eq=False)
class _Subscriber:
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    prefill: list[tuple[int, int, float]] = field(default_factory=list)
    decode: list[tuple[int, int, float]] = field(default_factory=list)
    fetches: list[tuple[int, float]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class EventHub:
    """Fans the pool's block events and observed timings out to every subscriber."""

    def __init__(self, pool, load: Callable[[], dict]) -> None:
        self.pool = pool
        self.load = load
        self._subs: set[_Subscriber] = set()
        self._seq = itertools.count(1)

    def pump(self) -> None:
        events = self.pool.drain_events()
        if not events or not self._subs:
            return
        for sub in self._subs:
            for kind, h in events:
                (sub.stored if kind == "stored" else sub.removed).append(h)
            sub.wake.set()

    def record_prefill(self, new: int, cached: int, ms: float) -> None:
        self.pump()
        for sub in self._subs:
            if len(sub.prefill) < MAX_PENDING:
                sub.prefill.append((new, cached, ms))
            sub.wake.set()

    def record_decode(self, batch: int, kv_tokens: int, ms: float) -> None:
        for sub in self._subs:
            if len(sub.decode) < MAX_PENDING:
                sub.decode.append((batch, kv_tokens, ms))

    def record_store_fetch(self, nbytes: int, ms: float) -> None:
        """A fetch from the cluster store: what the conductor's fetch-versus-recompute
        decision learns the store path's real cost from."""
        for sub in self._subs:
            if len(sub.fetches) < MAX_PENDING:
                sub.fetches.append((nbytes, ms))

    def _load(self, sub: _Subscriber) -> pb.NodeLoad:
        info = self.load()
        load = pb.NodeLoad(
            queue_depth=info.get("queue_depth", 0),
            running=info.get("running", 0),
            kv_blocks_free=info.get("kv_blocks_free", self.pool.num_free),
            kv_blocks_total=self.pool.num_blocks,
            reserves_seen=info.get("reserves", 0),
        )
        load.prefill_samples.extend(
            pb.PrefillSample(new_tokens=n, cached_tokens=c, ms=ms) for n, c, ms in sub.prefill
        )
        load.decode_samples.extend(
            pb.DecodeSample(batch=b, kv_tokens=k, ms=ms) for b, k, ms in sub.decode
        )
        load.store_fetches.extend(pb.StoreFetchSample(bytes=b, ms=ms) for b, ms in sub.fetches)
        for peer, bw in info.get("bandwidth", {}).items():
            load.bandwidth_bytes_per_s[peer] = bw
        sub.prefill, sub.decode, sub.fetches = [], [], []
        return load

    async def stream(self, interval_s: float):
        """The WatchEvents stream of one subscriber (an async generator)."""
        sub = _Subscriber()
        self.pump()  # what happened before this subscriber is in the snapshot
        self._subs.add(sub)
        try:
            yield pb.NodeEvent(
                seq=next(self._seq),
                reset=True,
                stored=self.pool.prefix_cache.hashes(),
                load=self._load(sub),
            )
            while True:
                try:
                    async with asyncio.timeout(interval_s):
                        await sub.wake.wait()
                except TimeoutError:
                    pass
                sub.wake.clear()
                self.pump()
                stored, removed = sub.stored, sub.removed
                sub.stored, sub.removed = [], []
                yield pb.NodeEvent(
                    seq=next(self._seq), stored=stored, removed=removed, load=self._load(sub)
                )
        finally:
            self._subs.discard(sub)
