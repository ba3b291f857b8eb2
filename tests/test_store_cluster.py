"""The store as real processes (etcd, store-master, store-nodes) driven by StoreClient:
the API, events, hot-block replication, the SSD tier, a store-master restart (nodes
re-report) and a node SIGKILLed under load."""

from __future__ import annotations

import asyncio
import glob
import os
import random
import signal
import struct
import time
import zlib

import grpc
import pytest

from kvmesh.loadtest.store_cluster import StoreCluster
from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.rdma import TransferEngine
from kvmesh.services.common.settings import DEV_SECRET
from kvmesh.services.store.client import StoreClient


def value(key: bytes, n: int) -> bytes:
    body = key + random.randbytes(max(0, n - len(key) - 4))
    return body + struct.pack("<I", zlib.crc32(body))


def intact(key: bytes, v: bytes | None) -> bool:
    return (
        v is not None and v.startswith(key) and struct.unpack("<I", v[-4:])[0] == zlib.crc32(v[:-4])
    )


def with_client(master: str, fn, node_id: str = "tester"):
    async def main():
        te = TransferEngine(DEV_SECRET.encode())
        await te.start()
        cl = StoreClient(te, master, node_id, rpc_timeout=3)
        try:
            return await fn(cl)
        finally:
            await cl.close()
            await te.close()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    c = StoreCluster(
        str(tmp_path_factory.mktemp("store3")),
        nodes=3,
        segment="32MiB",
        master_args=["--hot-reads", "4", "--max-replicas", "2"],
    )
    c.start()
    yield c
    c.stop()


def test_client_api(store):
    async def body(cl: StoreClient):
        assert await cl.put(b"alpha", b"A" * 1000)
        assert await cl.get(b"alpha") == b"A" * 1000
        assert await cl.get(b"missing") is None
        keys = [os.urandom(16) for _ in range(64)] + [b"g" * 256]
        vals = [value(k, random.choice([4096, 70000])) for k in keys]
        assert all(await cl.batch_put(keys, vals))
        assert await cl.batch_put(keys[:2], vals[:2]) == [True, True]  # already present
        got = await cl.batch_get(keys + [b"nope"])
        assert got[-1] is None and all(intact(k, v) for k, v in zip(keys, got))
        assert await cl.exists(keys[:3] + [b"nope"]) == [True, True, True, False]
        assert await cl.prefix_len(keys[:3] + [b"nope"] + keys[3:5]) == 3
        assert await cl.remove(keys[:4]) == 4
        assert await cl.exists(keys[0]) is False
        with pytest.raises(ValueError):
            await cl.put(b"x" * 257, b"v")
        # zero-copy: from a registered buffer into one, four blocks in one call each
        src, dst = bytearray(os.urandom(4 * 8192)), bytearray(4 * 8192)
        rs, rd = cl.te.register(src), cl.te.register(dst)
        zk = [os.urandom(16) for _ in range(4)]
        offs = [i * 8192 for i in range(4)]
        assert all(await cl.put_from(zk, rs, offs, [8192] * 4))
        assert await cl.get_into(zk, rd, offs[::-1]) == [8192] * 4
        assert dst == src[24576:] + src[16384:24576] + src[8192:16384] + src[:8192]
        assert await cl.pin(zk[:1]) == 1
        assert cl.stats["lease_expired"] == 0

    with_client(store.master, body)
    s = store.stats()
    assert s.pinned == 1 and s.segments == 3


def test_watch_blocks_events(store):
    async def body(cl: StoreClient):
        async with grpc.aio.insecure_channel(store.master) as ch:
            stream = pbg.StoreMasterStub(ch).WatchBlocks(pb.WatchBlocksRequest())
            events: asyncio.Queue = asyncio.Queue()

            async def pump():
                async for msg in stream:
                    for ev in (msg, *msg.more):  # coalesced events, in order
                        events.put_nowait(ev)

            reader = asyncio.create_task(pump())

            async def next_event(key: bytes, timeout: float):
                async with asyncio.timeout(timeout):
                    while bytes((ev := await events.get()).hash) != key:
                        pass
                    return ev

            # the stream is subscribed once it carries the event of a put made after it
            deadline = time.monotonic() + 10
            while True:
                probe = os.urandom(16)
                assert await cl.put(probe, b"p" * 64)
                try:
                    await next_event(probe, 0.5)
                    break
                except TimeoutError:
                    assert time.monotonic() < deadline, "WatchBlocks never subscribed"
            k = os.urandom(16)
            assert await cl.put(k, b"e" * 4096)
            assert await cl.remove(k) == 1
            seen = [await next_event(k, 10), await next_event(k, 10)]
            reader.cancel()
            stream.cancel()
        assert [e.type for e in seen] == ["stored", "removed"]
        assert seen[0].seq < seen[1].seq and seen[0].tier == "dram"
        assert seen[0].node_id.startswith("store-node-") and seen[0].size == 4096

    with_client(store.master, body)


def test_hot_block_gets_a_second_replica(store):
    async def body(cl: StoreClient):
        k = os.urandom(16)
        v = value(k, 65536)
        assert await cl.put(k, v)
        for _ in range(12):
            assert intact(k, await cl.get(k))
        return k

    before = store.stats().replications
    k = with_client(store.master, body)
    store.wait(lambda s: s.replications > before, 10, "a hot-block replica")
    with grpc.insecure_channel(store.master) as ch:
        r = pbg.StoreMasterStub(ch).GetReplicas(pb.GetReplicasRequest(hashes=[k]), timeout=2)
        assert len(r.replicas) == 1
    # both replicas serve correct bytes: read many times, reads spread by load
    got = with_client(store.master, lambda cl: asyncio.gather(*(cl.get(k) for _ in range(1))))
    assert intact(k, got[0])


def test_store_master_restart_nodes_rereport(store):
    keys = [os.urandom(16) for _ in range(40)]
    vals = [value(k, 16384) for k in keys]
    assert all(with_client(store.master, lambda cl: cl.batch_put(keys, vals)))
    n_before = store.stats().blocks
    # nodes learn what they hold from the event stream: a block committed in the last
    # milliseconds before a master crash may be lost (a cache miss, nothing worse), so
    # crash it once every node has indexed what it holds
    store.wait_indexed(15)
    store.kill("store-master-0", signal.SIGKILL)

    async def during(cl: StoreClient):  # the master is down: a miss, never an error
        return await cl.get(keys[0]), await cl.put(os.urandom(16), b"x")

    assert with_client(store.master, during) == (None, False)
    store.start_master()
    s = store.wait(lambda s: s.segments == 3 and s.blocks >= n_before, 30, "re-report")
    assert s.blocks == n_before
    got = with_client(store.master, lambda cl: cl.batch_get(keys))
    assert all(intact(k, v) for k, v in zip(keys, got))


def test_node_sigkill_under_load(store):
    """Puts and gets run while a node is SIGKILLed; puts in flight fail cleanly, its
    replicas leave at once when its lease ends, every remaining block reads intact."""
    written: list[bytes] = []

    async def body(cl: StoreClient):
        stop = time.monotonic() + 6
        killed = False
        errors = 0
        while time.monotonic() < stop:
            keys = [os.urandom(16) for _ in range(8)]
            vals = [value(k, 32768) for k in keys]
            try:
                ok = await cl.batch_put(keys, vals)
                written.extend(k for k, o in zip(keys, ok) if o)
                got = await cl.batch_get(random.sample(written, min(8, len(written))))
                # a block may vanish with its node, but what is read is intact
                assert all(
                    v is None or v[-4:] == struct.pack("<I", zlib.crc32(v[:-4])) for v in got
                )
            except (grpc.RpcError, OSError):
                errors += 1
            if not killed and time.monotonic() > stop - 4:
                await asyncio.to_thread(store.kill, "store-node-1", signal.SIGKILL)
                killed = True
        return errors

    assert with_client(store.master, body) == 0
    s = store.wait(lambda s: s.segments == 2, 15, "the dead node's segment dropped")

    async def check(cl: StoreClient):
        present = await cl.exists(written)
        alive = [k for k, p in zip(written, present) if p]
        got = await cl.batch_get(alive)
        return alive, got

    alive, got = with_client(store.master, check)
    assert 0 < len(alive) < len(written)
    assert all(intact(k, v) for k, v in zip(alive, got))
    assert s.blocks >= len(alive)


def test_ssd_tier_spill_promote_corrupt(tmp_path):
    ssd = tmp_path / "ssd"
    c = StoreCluster(
        str(tmp_path / "c"),
        nodes=1,
        segment="2MiB",
        node_args=["--ssd-dir", str(ssd), "--ssd-bytes", "64MiB"],
    )
    try:
        c.start()
        keys = [os.urandom(16) for _ in range(24)]
        vals = [value(k, 256 * 1024) for k in keys]  # 6 MiB into a 2 MiB segment

        async def fill(cl: StoreClient):
            out = []
            for k, v in zip(keys, vals):
                out.append(await cl.put(k, v))
                await asyncio.sleep(0.05)  # let the background evictor spill
            return out

        assert all(with_client(c.master, fill))
        s = c.wait(lambda s: s.spills > 0, 10, "spills")
        assert s.ssd_blocks > 0 and s.bytes_used <= 0.9 * s.bytes_total
        files = glob.glob(str(ssd / "*.blk"))
        assert files
        # corrupt one spilled file: that key is a miss, the others promote back intact
        victim = keys[0]
        import hashlib

        path = ssd / (hashlib.sha1(victim).hexdigest() + ".blk")
        assert path.exists()
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(data)

        async def read(cl: StoreClient):  # one at a time: each promotion needs DRAM room
            got = [await cl.get(keys[0])]
            for k in keys[1:6]:
                v = await cl.get(k)
                for _ in range(30):
                    # no room yet is a miss too (space held a moment longer on a loaded
                    # box: a spill in flight, a closed writer's slots not yet given
                    # back); the room comes, and the block must promote back intact
                    if v is not None:
                        break
                    await asyncio.sleep(0.1)
                    v = await cl.get(k)
                got.append(v)
            return got

        got = with_client(c.master, read)
        assert got[0] is None
        assert all(intact(k, v) for k, v in zip(keys[1:6], got[1:])), [
            None if v is None else ("ok" if intact(k, v) else f"CORRUPT {len(v)}")
            for k, v in zip(keys[1:6], got[1:])
        ]
        s = c.stats()
        assert s.promotions >= 5
    finally:
        c.stop()


@pytest.mark.parametrize(
    "fast,poll_us",
    [(True, 200), (True, 0), (False, 200)],
    ids=["raw-tcp", "raw-tcp-no-polling", "grpc"],
)
def test_client_lends_own_segment(store, fast, poll_us):
    """A client that lends memory (as Mooncake Store clients do) puts locally in one
    call per put/batch and gets its own blocks by a memory copy; another client reads
    them over the transfer engine; both control paths (raw TCP and gRPC) agree."""

    async def body():
        te = TransferEngine(DEV_SECRET.encode(), poll_us=poll_us)
        te2 = TransferEngine(DEV_SECRET.encode(), poll_us=poll_us)
        await te.start()
        await te2.start()
        cl = StoreClient(te, store.master, f"lender-{int(fast)}", rpc_timeout=3, fast_path=fast)
        other = StoreClient(te2, store.master, "reader", rpc_timeout=3, fast_path=fast)
        segments = store.stats().segments
        try:
            # room enough that the big values below never push the shared store (full
            # of earlier tests' blocks, many still leased) over its high watermark
            await cl.lend(64 << 20)
            keys = [os.urandom(16) for _ in range(40)]
            vals = {k: value(k, 4096) for k in keys}
            assert await cl.put(keys[0], vals[keys[0]])
            assert await cl.put(keys[0], vals[keys[0]])  # present: still True
            assert all(await cl.batch_put(keys[1:], [vals[k] for k in keys[1:]]))
            assert cl.stats["local_puts"] == 40
            assert (cl._fast is not None) == fast
            got = await cl.batch_get(keys)
            assert all(intact(k, v) for k, v in zip(keys, got))
            assert cl.stats["local_gets"] >= 40
            assert await cl.exists(keys) == [True] * 40
            assert await cl.prefix_len(keys + [b"x" * 16]) == 40
            # a reader without a segment reads the lender's blocks over the transfer engine
            got2 = await other.batch_get(keys[:8])
            assert all(intact(k, v) for k, v in zip(keys[:8], got2))
            # zero-copy put_from/get_into through registered buffers, also local
            src = bytearray(2 * 8192)
            src[:8192] = value(b"zc-a" * 4, 8192)
            src[8192:] = value(b"zc-b" * 4, 8192)
            rid = te.register(src)
            zk = [b"zc-a" * 4, b"zc-b" * 4]
            assert await cl.put_from(zk, rid, [0, 8192], [8192, 8192]) == [True, True]
            dst = bytearray(2 * 8192)
            did = te.register(dst)
            assert await cl.get_into(zk, did, [0, 8192]) == [8192, 8192]
            assert dst == src
            # mixed sizes go through PutStart, still placed locally (local-first)
            mk = [os.urandom(16), os.urandom(16)]
            assert await cl.batch_put(mk, [b"a" * 100, b"b" * 300]) == [True, True]
            assert await cl.batch_get(mk) == [b"a" * 100, b"b" * 300]
            # values of a megabyte and more are copied in parallel, in and out
            big = [os.urandom(16) for _ in range(3)]
            bvals = [value(k, (2 << 20) + 7 * i) for i, k in enumerate(big)]
            assert await cl.put(big[0], bvals[0])
            assert await cl.batch_put(big[1:], bvals[1:]) == [True, True]
            assert await cl.batch_get(big) == bvals  # local copies
            assert await other.batch_get(big) == bvals  # over the engine
            assert await cl.remove(keys + zk + mk + big) == 47
            assert await cl.batch_get(keys[:2]) == [None, None]
        finally:
            await other.close()
            await cl.close()
            await te2.close()
            await te.close()
        # the lender's segment left with it
        store.wait(lambda s: s.segments == segments, 10, "lender's segment unmounted")

    asyncio.run(body())
