"""Large values on the store's remote path (a client that lends nothing, a store-node that
holds the segment), as real processes: the bytes API sends a large value straight from
the caller's buffer (no staging copy; the transient regions are gone afterwards, also
after a failed write), and a put of values up to ``REMOTE_SLOT_MAX`` goes through the
pool of held slots (one PUT_SLOTS commit, no PUT_START/PUT_END) whenever the pool's byte
budget holds them; every byte comes back."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvmesh.loadtest.store_cluster import StoreCluster
from kvmesh.rdma import TransferEngine, TransferError
from kvmesh.services.store import client as client_mod
from kvmesh.services.store import direct, remote_put
from kvmesh.services.store.client import StoreClient
from kvmesh.services.store.fastconn import FastConn
from kvmesh.services.store_master import wire
from tests.store_util import run_client

MiB = 1 << 20


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    c = StoreCluster(str(tmp_path_factory.mktemp("remote-large")), nodes=1, segment="256MiB")
    c.start()
    yield c
    c.stop()


def run(master: str, fn, **kw):
    return run_client(master, fn, "large-tester", **kw)


def spy_methods(monkeypatch) -> list[int]:
    """The methods of every fast-path frame sent from now on."""
    sent: list[int] = []
    real = FastConn.call

    def spy(self, method, body, timeout):
        sent.append(method)
        return real(self, method, body, timeout)

    monkeypatch.setattr(FastConn, "call", spy)
    return sent


def no_copies(monkeypatch) -> None:
    def refuse(*_):
        raise AssertionError("a large value was copied into the staging region")

    monkeypatch.setattr(client_mod, "copy_into", refuse)
    monkeypatch.setattr(remote_put, "copy_into", refuse)


def test_large_bytes_puts_go_from_the_callers_buffers(store, monkeypatch):
    """bytes (read-only), bytearray, a memoryview slice into a bigger buffer and a numpy
    array of another dtype: none is copied into staging, no staging region is made, the
    regions registered for the put are gone after it, and every byte comes back."""
    big = direct.DIRECT_PUT_MIN
    backing = bytearray(os.urandom(3 * big))
    vals = [
        os.urandom(big),
        bytearray(os.urandom(big + 5)),
        memoryview(backing)[big + 3 : 2 * big + 3 + 11],
        np.frombuffer(os.urandom(4 * MiB), dtype=np.float32),
    ]
    want = [bytes(memoryview(v).cast("B")) for v in vals]
    keys = [f"large-direct-{i}".encode() for i in range(len(vals))]

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.exists(b"warm-up") is False
        before = te._regions.ids()
        no_copies(monkeypatch)
        assert await cl.batch_put(keys[:3], vals[:3]) == [True] * 3  # PUT_START/PUT_END
        assert await cl.put(keys[3], vals[3])  # through a held slot
        assert cl._staging is None  # nothing staged
        assert te._regions.ids() == before  # the transient regions are gone
        assert await cl.batch_get(keys) == want
        await cl.remove(keys)
        return cl.stats

    stats = run(store.master, body)
    assert stats["master_errors"] == 0 and stats["put_failed"] == 0


def test_a_failed_direct_write_stores_nothing_and_leaves_no_region(store, monkeypatch):
    """A write from the caller's buffer that the engine fails: the put is False, the key
    is not visible, and the put's regions are unregistered all the same."""
    val = os.urandom(2 * MiB)

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.exists(b"warm-up") is False
        before = te._regions.ids()
        real = te.write

        def failing(peer, slices):
            raise TransferError("injected")

        te.write = failing  # type: ignore[method-assign]
        assert await cl.put(b"large-failed", val) is False
        assert await cl.batch_put([b"large-failed-a", b"large-failed-b"], [val, val]) == [
            False,
            False,
        ]
        te.write = real  # type: ignore[method-assign]
        assert te._regions.ids() == before
        assert (
            await cl.exists([b"large-failed", b"large-failed-a", b"large-failed-b"]) == [False] * 3
        )
        assert await cl.put(b"large-failed", val)  # the same key goes in afterwards
        assert await cl.get(b"large-failed") == val
        await cl.remove([b"large-failed"])

    run(store.master, body)


def test_large_puts_are_one_commit_each_through_held_slots(store, monkeypatch):
    """4 MiB puts (bytes and zero-copy), then 16 MiB ones by the same client (the 4 MiB
    slots it holds give way): after the PUT_RESERVE that fills the pool, each is a write
    and ONE PUT_SLOTS commit (which refills the pool); every byte comes back."""
    vals = [os.urandom(4 * MiB) for _ in range(5)]
    keys = [f"large-pooled-{i}".encode() for i in range(len(vals))]

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.exists(b"warm-up") is False
        sent = spy_methods(monkeypatch)
        for k, v in zip(keys, vals):
            assert await cl.put(k, v)
        assert sent.count(wire.PUT_RESERVE) == 1 and sent[0] == wire.PUT_RESERVE
        assert sent.count(wire.PUT_SLOTS) == len(keys)
        assert wire.PUT_START not in sent and wire.PUT_END not in sent
        src = np.frombuffer(os.urandom(8 * MiB), dtype=np.uint8).copy()
        dst = np.zeros_like(src)
        rs, rd = te.register(src), te.register(dst)
        sent.clear()
        zk = [b"large-pooled-zc-0", b"large-pooled-zc-1"]
        for i, k in enumerate(zk):
            assert await cl.put_from([k], rs, [i * 4 * MiB], [4 * MiB]) == [True]
        assert sent == [wire.PUT_SLOTS, wire.PUT_SLOTS]
        assert await cl.get_into(zk, rd, [0, 4 * MiB]) == [4 * MiB] * 2
        assert np.array_equal(src, dst)
        assert await cl.batch_get(keys) == vals
        await cl.remove([*keys, *zk])
        # 16 MiB puts on the same client: the 4 MiB slots it holds make room (PUT_RELEASE
        # of the oldest), one PUT_RESERVE, then each is one PUT_SLOTS commit
        sent.clear()
        huge = [os.urandom(16 * MiB) for _ in range(3)]
        ks = [f"large-pooled-16-{i}".encode() for i in range(3)]
        for k, v in zip(ks, huge):
            assert await cl.put(k, v)
        assert sent.count(wire.PUT_SLOTS) == 3 and sent.count(wire.PUT_RESERVE) == 1
        assert sent[0] == wire.PUT_RELEASE and wire.PUT_START not in sent
        assert await cl.batch_get(ks) == huge
        await cl.remove(ks)
        return cl.stats

    stats = run(store.master, body)
    assert stats["master_errors"] == 0 and stats["put_failed"] == 0


def test_a_value_the_pool_budget_cannot_hold_is_put_with_start_and_end(store, monkeypatch):
    """A client whose pool budget is smaller than the value (and a value above
    REMOTE_SLOT_MAX) puts it through PUT_START -> write -> PUT_END; it reads back."""
    val = os.urandom(6 * MiB)

    async def body(cl: StoreClient, te: TransferEngine):
        assert await cl.exists(b"warm-up") is False
        sent = spy_methods(monkeypatch)
        assert await cl.put(b"large-unpooled", val)
        assert sent == [wire.PUT_START, wire.PUT_END]
        monkeypatch.setattr(remote_put, "REMOTE_SLOT_MAX", 4 * MiB)
        cl._rslots.max_bytes = 1 << 30  # the budget would hold it; the size limit does not
        sent.clear()
        assert await cl.put(b"large-too-big", val)
        assert sent == [wire.PUT_START, wire.PUT_END]
        assert await cl.batch_get([b"large-unpooled", b"large-too-big"]) == [val, val]
        await cl.remove([b"large-unpooled", b"large-too-big"])

    run(store.master, body, remote_pool_bytes=4 * MiB)
