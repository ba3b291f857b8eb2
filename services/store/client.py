"""StoreClient: the cluster KV store from a process's point of view, in Mooncake Store's
shape - ``put``/``get``/``batch_put``/``batch_get``/``exists``/``remove`` on bytes, and
zero-copy ``put_from``/``get_into`` between transfer-engine registered buffers and the
segments that hold the blocks. Control goes to the store-master (gRPC, or its raw-TCP
control path when it advertises one in ``StoreHello``); bytes move over the transfer
engine - or, for a replica in the client's *own* segment, by a memory copy.

Keys are bytes: 16-byte block hashes for KV, or any key of 1..256 bytes.

Topology: a client may lend memory itself (``await lend(size)``, as Mooncake Store
clients do, or ``segment=`` a :class:`SegmentHost` its node already lends). Then
  * puts are local-first: the client keeps a small pool of slots it *reserved* in its
    own segment (``PutLocal``); a put copies the value into a slot and commits key ->
    slot in ONE call, which also refills the pool. A block is visible only after that
    commit, i.e. after its bytes are written. Slots belong to one mount of the segment:
    the segment re-mounts only after bumping ``SegmentHost.epoch``, which empties the
    pool, and the master frees a segment's reservations when it is re-mounted;
  * gets of a replica in the own segment copy from it (the master prefers the reader's
    own replica); other replicas are read with the transfer engine as before.

Semantics a caller can rely on:
  * a put is all-or-nothing per key: ``PutStart`` -> transfer-engine write -> ``PutEnd``,
    or (local) copy into a reserved slot -> ``PutLocal`` commit; a failed write aborts
    the key, and a key whose placement vanished meanwhile (its node died, the put was
    reclaimed, the master restarted) is reported as not stored;
  * a get never returns bytes read after its read lease ended: the lease deadline is
    computed locally as (time the ``GetReplicas`` request was *sent*) + ``lease_ms``, so
    clock skew cannot extend it; a late read is a miss (``stats["lease_expired"]``) and
    the caller recomputes;
  * every failure of the store (master down, node gone, transfer error) is a miss or a
    ``False``, never an exception, except bad arguments (``ValueError``);
  * a client that lends nothing remembers where it saw each key (its own pooled puts,
    earlier gets) and reads there while it asks the master, using those bytes only if
    the master's answer names the same replica (place and generation;
    :mod:`kvmesh.services.store.located`): a small get is one round trip, not two. On a
    miss or a mismatch ``get_into`` may have written the remembered replica's bytes into
    the caller's buffer (the key's result is -1, or the right value overwrites them);
  * a remote bytes put of values of ``direct.DIRECT_PUT_MIN`` or more sends them from
    the caller's buffers (:mod:`kvmesh.services.store.direct`): a mutable value must not
    change until its put returns (smaller ones are copied into a staging region first).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Sequence

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.rdma import Slice, TransferEngine, TransferError
from kvmesh.rdma.wire import LoopTurns
from kvmesh.services.common import channels
from kvmesh.services.common.channels import make_channel
from kvmesh.services.common.registry import Membership
from kvmesh.services.common.telemetry import record_span
from kvmesh.services.store import direct, limits
from kvmesh.services.store.batching import gather_results, per_key
from kvmesh.services.store.copy import copy_into
from kvmesh.services.store.fastconn import CallError, FastConn, FastConnError
from kvmesh.services.store.gets import Gets
from kvmesh.services.store.limits import Loc, bytes_view, check_keys
from kvmesh.services.store.local_put import LocalPuts
from kvmesh.services.store.located import Locations, ReadAhead
from kvmesh.services.store.remote_pool import RemotePool
from kvmesh.services.store.remote_put import RemotePuts
from kvmesh.services.store_master import wire

log = logging.getLogger(__name__)

_PB_RESP = {
    "PutStart": pb.PutStartResponse,
    "PutEnd": pb.PutEndResponse,
    "Pin": pb.PinResponse,
    "Unpin": pb.PinResponse,
    "Stats": pb.StoreStatsResponse,
}


class StoreClient(LocalPuts, RemotePuts, Gets, ReadAhead):
    """``te`` must be started; ``master`` is a store-master gRPC address or a started
    :class:`Membership` of the cluster (any live store-master is used). ``segment``: the
    :class:`SegmentHost` this node lends (enables the local paths); or call :meth:`lend`.
    ``fast_path``: use the master's raw-TCP control path when it offers one (over TLS
    when gRPC uses TLS). ``tls``: TLS files for both instead of the process's."""

    # round trips to the master of one remote call of each kind (the benchmark's
    # breakdown of where the time goes)
    # (a put of up to REMOTE_SLOT_MAX bytes: only the commit, into a slot held before)
    CONTROL_ROUND_TRIPS = {"put": 2, "put_pooled": 1, "get": 1}

    def __init__(
        self,
        te: TransferEngine,
        master: str | Membership,
        node_id: str = "",
        rpc_timeout: float = 5.0,
        staging_bytes: int = 4 << 20,
        segment=None,
        fast_path: bool = True,
        pool_bytes: int = 32 << 20,
        pool_slots: int = 64,
        tls: channels.TlsFiles | None = None,
        remote_pool_bytes: int = 32 << 20,
        remote_pool_slots: int = 256,
    ) -> None:
        self.te = te
        self.tls = tls  # None: the process's settings (channels.configure), as gRPC does
        self.master = master
        self.node_id = node_id
        self.rpc_timeout = rpc_timeout
        self.segment = segment
        self.fast_path = fast_path
        self.pool_bytes, self.pool_slots = pool_bytes, pool_slots
        self._own_segment = False
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._staging: bytearray | None = None
        self._staging_region = -1
        self._staging_min = staging_bytes
        self._staging_lock = asyncio.Lock()
        self._fast: FastConn | None = None
        self._turns = LoopTurns()
        self._fast_addr = ""  # master address the connection belongs to
        self._fast_retry = 0.0
        self._fast_connecting: asyncio.Future | None = None
        self._pool: dict[int, list[int]] = {}  # size -> reserved slot offsets
        self._pool_epoch = -1
        # remote slots (no own segment), for the fast connection they were reserved on
        # (see :mod:`kvmesh.services.store.remote_pool`); 256 of them, so a batch of 128
        # small values takes the two-step pooled put, not PUT_START/PUT_END (the byte
        # budget still bounds what large values hold)
        self._rslots = RemotePool(remote_pool_bytes, remote_pool_slots)
        # where keys were last seen: a get reads there while it asks (located.py)
        self._where = Locations()
        self.stats = {
            "puts": 0,
            "put_failed": 0,
            "gets": 0,
            "misses": 0,
            "lease_expired": 0,
            "read_failed": 0,
            "master_errors": 0,
            "local_puts": 0,
            "local_gets": 0,
            "read_ahead_used": 0,
            "read_ahead_wasted": 0,
        }

    # -- plumbing --------------------------------------------------------------------------
    def master_address(self) -> str | None:
        if isinstance(self.master, str):
            return self.master
        for key, value in self.master.nodes.items():
            if "/store-master/" in key:
                addr = json.loads(value).get("grpc")
                if addr:
                    return addr
        return None

    def stub(self) -> pbg.StoreMasterStub | None:
        addr = self.master_address()
        if addr is None:
            return None
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = make_channel(addr, self.tls)
        return pbg.StoreMasterStub(ch)

    async def lend(self, size: int, timeout: float | None = None) -> None:
        """Lends ``size`` bytes of this process's memory to the store (untracked: see
        :class:`SegmentHost`), so puts land locally and gets of them are memory copies."""
        from kvmesh.services.store.segment import SegmentHost

        if self.segment is not None:
            raise RuntimeError("this client already has a segment")
        addr = self.master_address()
        if addr is None:
            raise RuntimeError("no store-master to lend to")
        host = SegmentHost(self.te, self.node_id, size, track=False)
        host.register()
        host.follow(addr)
        self.segment, self._own_segment = host, True
        try:
            async with asyncio.timeout(timeout or self.rpc_timeout):
                await host.mounted.wait()
        except TimeoutError:
            log.warning("store: segment not mounted yet; puts go remote until it is")

    async def close(self) -> None:
        self._rslots.closing = True  # puts in flight give back the slots they bring
        if self._own_segment and self.segment is not None:
            host, self.segment = self.segment, None
            await self._call(
                "UnmountSegment", pb.UnmountSegmentRequest(node_id=self.node_id), fast=False
            )
            await host.close()
            if host.region >= 0:
                self.te.unregister(host.region)
        if self._fast is not None:
            await self._give_back_pool()
            self._fast.close()
            self._fast = None
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        if self._staging_region >= 0:
            self.te.unregister(self._staging_region)
            self._staging_region = -1

    async def _conn(self) -> FastConn | None:
        """The raw-TCP connection to the current master, when it offers one."""
        if not self.fast_path:
            return None
        addr = self.master_address()
        c = self._fast
        if c is not None and not c.closed and self._fast_addr == addr:
            return c
        if addr is None or time.monotonic() < self._fast_retry:
            return None
        if self._fast_connecting is not None:
            return await asyncio.shield(self._fast_connecting)
        fut = self._fast_connecting = asyncio.get_running_loop().create_future()
        conn = None
        try:
            self._fast_retry = time.monotonic() + 2.0
            if c is not None:
                c.close()
            self._fast = None
            stub = self.stub()
            hello = await stub.StoreHello(pb.StoreHelloRequest(), timeout=self.rpc_timeout)
            if hello.fast_address:
                tls = self.tls or channels.current()  # TLS exactly when gRPC uses it
                conn = await FastConn.connect(
                    hello.fast_address,
                    self.rpc_timeout,
                    getattr(self.te, "poll_us", 200),
                    channels.ssl_client_context(tls),
                    tls.server_name,
                )
                self._fast, self._fast_addr = conn, addr
        except (TimeoutError, grpc.aio.AioRpcError, OSError) as e:  # ssl.SSLError too
            log.debug("store fast path unavailable: %s", e)
        finally:
            self._fast_connecting = None
            fut.set_result(conn)
        return conn

    async def _fast_call(self, method: int, body: bytes) -> bytes | None | bool:
        """The body of the answer; None after an error; False when there is no fast path
        (the caller uses gRPC)."""
        c = self._fast
        if c is None or c.closed or self._fast_addr != self.master_address():
            c = await self._conn()
            if c is None:
                return False
        return await self._call_on(c, method, body, check=False)

    async def _call_on(
        self, c: FastConn, method: int, body: bytes, check: bool = True
    ) -> bytes | None | bool:
        """As :meth:`_fast_call` on connection ``c`` only, never a new one: None when
        ``c`` closed or (``check``) is no longer this client's connection to the current
        master (the caller has just checked that when not ``check``)."""
        if check and (c.closed or c is not self._fast or self._fast_addr != self.master_address()):
            return None
        try:
            fut = c.call(method, body, self.rpc_timeout)
            if fut.done() and self._turns.owed():  # answered while polling: let others in
                await asyncio.sleep(0)
            return await fut
        except FastConnError as e:
            self.stats["master_errors"] += 1
            log.warning("store fast call failed: %s", e)
            return None
        except CallError as e:
            if e.status == grpc.StatusCode.UNIMPLEMENTED.value[0]:
                return False  # an older master without this frame: gRPC serves it
            self.stats["master_errors"] += 1
            log.warning("store fast call refused: %s", e)
            return None

    async def _fast_traced(self, name: str, method: int, body: bytes) -> bytes | None | bool:
        return await self._traced(name, self._fast_call(method, body))

    async def _traced(self, name: str, call: Awaitable[bytes | None | bool]) -> bytes | None | bool:
        """Awaits the fast-path ``call`` under a span named as the gRPC call it stands for
        (``kvmesh.v1.StoreMaster/<name>``; the pooled put's frames have no gRPC twin), so a
        trace reads alike whichever path served it (no span when there is no fast path)."""
        t0 = time.time_ns()
        out = await call
        if out is not False:
            record_span(
                f"kvmesh.v1.StoreMaster/{name}",
                t0,
                attributes={"kvmesh.store_path": "fast"},
                error=None if out is not None else "store call failed",
            )
        return out

    async def _call(self, name: str, req, timeout: float | None = None, fast: bool = True):
        if fast and name in _PB_RESP:
            i = wire.PB_METHODS.index(name)
            body = await self._traced(
                name, self._fast_call(wire.PB_BASE + i, req.SerializeToString())
            )
            if body is not False:
                return None if body is None else _PB_RESP[name].FromString(body)
        stub = self.stub()
        if stub is None:
            self.stats["master_errors"] += 1
            return None
        try:
            return await getattr(stub, name)(req, timeout=timeout or self.rpc_timeout)
        except grpc.aio.AioRpcError as e:
            self.stats["master_errors"] += 1
            log.warning("store %s failed: %s %s", name, e.code(), e.details())
            return None

    # -- hot calls (raw TCP when offered, else gRPC) ---------------------------------------
    async def _get_replicas(
        self, keys: list[bytes], any_order: bool
    ) -> tuple[int, list[Loc], list[int] | None] | None:
        """(lease_ms, placements, their generations: None from a master without them)."""
        body = await self._fast_call(
            wire.GET, wire.pack_get(keys, self.node_id, any_order, gens=True)
        )
        if body is not False:
            if body is None:
                return None
            lease_ms, locs, gens = wire.unpack_get_resp_gens(body)
            self._where.answer(keys, locs, gens)
            return lease_ms, locs, gens
        resp = await self._call(
            "GetReplicas",
            pb.GetReplicasRequest(hashes=keys, node_id=self.node_id, any_order=any_order),
        )
        if resp is None:
            return None
        out, i = [], 0
        for p in resp.replicas:
            while keys[i] != p.hash:
                i += 1
            out.append((i, p.data_address, p.region_id, p.node_id, p.offset, p.size))
            i += 1
        self._where.answer(keys, out, None)
        return resp.lease_ms, out, None

    async def _exists(self, keys: list[bytes], any_order: bool) -> tuple[int, list[bool]] | None:
        body = await self._fast_call(wire.EXISTS, wire.pack_exists(keys, any_order))
        if body is not False:
            if body is None:
                return None
            return wire.unpack_exists_resp(body)
        resp = await self._call("Exists", pb.ExistsRequest(hashes=keys, any_order=any_order))
        return None if resp is None else (resp.prefix_blocks, list(resp.present))

    # -- zero-copy -------------------------------------------------------------------------
    async def put_from(
        self, keys: Sequence[bytes], region_id: int, offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        """Stores ``sizes[i]`` bytes at ``offsets[i]`` of local region ``region_id`` under
        ``keys[i]``. True per key when it is in the store afterwards (written now or
        already present); False when it did not fit or its write/commit failed."""
        keys = check_keys(keys)
        if not (len(keys) == len(offsets) == len(sizes)):
            raise ValueError("put_from: keys, offsets and sizes must have one entry each")
        if not keys:
            return []
        ok = [False] * len(keys)
        rest = list(range(len(keys)))
        if self._local_region() >= 0 and self._region_view(region_id, offsets[0], 1) is not None:

            def src(i: int) -> memoryview:
                return self._region_view(region_id, offsets[i], sizes[i])

            rest = await self._put_local(keys, sizes, src, ok)
        if rest:
            rk, rz, ro = (
                [keys[i] for i in rest],
                [sizes[i] for i in rest],
                [offsets[i] for i in rest],
            )
            sub = await self._put_pooled(rk, rz, region_id, offsets=ro)
            if sub is None:
                sub = await self._put_placed(rk, rz, region_id, offsets=ro)
            for i, v in zip(rest, sub):
                ok[i] = v
        self.stats["puts"] += sum(ok)
        self.stats["put_failed"] += len(ok) - sum(ok)
        return ok

    async def _put_start(
        self, keys: list[bytes], sizes: Sequence[int]
    ) -> tuple[list[Loc], set[int]] | None:
        """Places the absent keys: ([(key index, data address, region, node, offset,
        size)], indices of the keys already present or being put); None on failure."""
        body = await self._fast_traced(
            "PutStart", wire.PUT_START, wire.pack_put_start(self.node_id, keys, sizes)
        )
        if body is None:
            return None
        if body is not False:
            placed, present = wire.unpack_put_start_resp(body)
            return placed, set(present)
        same = all(z == sizes[0] for z in sizes)
        resp = await self._call(
            "PutStart",
            pb.PutStartRequest(
                node_id=self.node_id,
                hashes=keys,
                size=sizes[0] if same else 0,
                sizes=[] if same else list(sizes),
            ),
            fast=False,
        )
        if resp is None:
            return None
        where = {k: i for i, k in enumerate(keys)}
        skipped = {bytes(h) for h in resp.already_present}
        return (
            [
                (where[p.hash], p.data_address, p.region_id, p.node_id, p.offset, p.size)
                for p in resp.placements
            ],
            {i for i, k in enumerate(keys) if k in skipped},
        )

    async def _put_end(self, keys: list[bytes], abort: bool = False) -> set[bytes] | None:
        """Commits (or aborts) the keys' puts; -> the keys that failed (no pending put
        any more), None when the master could not be asked."""
        body = await self._fast_traced("PutEnd", wire.PUT_END, wire.pack_put_end(keys, abort))
        if body is None:
            return None
        if body is not False:
            return {keys[i] for i in wire.unpack_put_end_resp(body)[1]}
        resp = await self._call("PutEnd", pb.PutEndRequest(hashes=keys, abort=abort), fast=False)
        return None if resp is None else {bytes(h) for h in resp.failed}

    async def _put_placed(
        self,
        keys: list[bytes],
        sizes: Sequence[int],
        region_id: int | Sequence[int],
        offsets: Sequence[int] | None = None,
        values: Sequence[memoryview] | None = None,
    ) -> list[bool]:
        """PutStart -> write (transfer engine; a copy for a placement in the own
        segment) -> PutEnd: two round trips to the master whatever the batch.

        The bytes come from ``offsets`` of region ``region_id`` (zero-copy; one region
        per key when it is a sequence), or from ``values``, copied into the staging
        region ``region_id`` one by one after the placements are known (present keys are
        not copied) while the writes of those copied before are already on the wire
        (``PIPELINE_BYTES`` a write). Zero-copy writes are issued together and awaited
        directly (no task each)."""
        got = await self._put_start(keys, sizes)
        if got is None:
            return [False] * len(keys)
        placed, present = got
        regs = per_key(region_id, len(keys))
        pos = 0
        inflight: list[tuple[asyncio.Future, list[int]]] = []
        batch: dict[
            str, tuple[list[Slice], list[int], list[int]]
        ] = {}  # peer -> slices, idx, bytes

        def issue(peer: str) -> None:
            slices, idx, nbytes = batch.pop(peer)
            inflight.append((asyncio.ensure_future(self._write(peer, slices)), idx))

        for i, addr, region, _, off, size in placed:
            if values is not None:
                src_off, pos = pos, pos + size
                copy_into(self._staging_view[src_off:pos], values[i])
            else:
                src_off = offsets[i]
            if self._is_local(addr, region):
                src = self._region_view(regs[i], src_off, size)
                if src is not None:
                    self.segment.view[off : off + size] = src
                    continue
            item = batch.setdefault(addr, ([], [], [0]))
            item[0].append(Slice(regs[i], src_off, region, off, size))
            item[1].append(i)
            item[2][0] += size
            if values is not None and item[2][0] >= limits.PIPELINE_BYTES:
                issue(addr)
        failed: list[int] = []
        if values is None:  # nothing left to copy: every peer's write at once
            peers = list(batch)
            oks = await gather_results([self._write(p, batch[p][0]) for p in peers])
            for p, ok in zip(peers, oks):
                if not ok:
                    failed.extend(batch[p][1])
        else:
            for peer in list(batch):
                issue(peer)
        for fut, idx in inflight:
            if not await fut:
                failed.extend(idx)
        bad = set(failed)
        written = [keys[i] for i, *_ in placed if i not in bad]
        if failed:
            await self._put_end([keys[i] for i in failed], abort=True)
        ok = set(present)
        if written:
            lost = await self._put_end(written)
            if lost is not None:
                ok.update(i for i, *_ in placed if i not in bad and keys[i] not in lost)
        return [i in ok for i in range(len(keys))]

    async def _write(self, peer: str, slices: list[Slice]) -> bool:
        try:
            await self.te.write(peer, slices)
            return True
        except (TransferError, OSError) as e:
            log.warning("store put to %s failed (%s); aborting %d key(s)", peer, e, len(slices))
            return False

    # -- bytes API -------------------------------------------------------------------------
    async def put(self, key: bytes, value: bytes | bytearray | memoryview) -> bool:
        return (await self.batch_put([key], [value]))[0]

    async def batch_put(self, keys: Sequence[bytes], values: Sequence) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError("batch_put: one value per key")
        views = [bytes_view(v) for v in values]
        sizes = [len(v) for v in views]
        if any(s == 0 for s in sizes):
            raise ValueError("batch_put: values must not be empty")
        keys = check_keys(keys)
        if not keys:
            return []
        ok = [False] * len(keys)
        rest = list(range(len(keys)))
        if self._local_region() >= 0:
            rest = await self._put_local(keys, sizes, views.__getitem__, ok)
        if rest:
            rk, rz = [keys[i] for i in rest], [sizes[i] for i in rest]
            rv = [views[i] for i in rest]
            if direct.usable(self.te, rv):  # large values go from the caller's buffers
                sub = await direct.put(self.te, rk, rz, rv, self._put_pooled, self._put_placed)
            else:
                async with self._staging_lock:
                    _, region = self._stage(sum(rz))
                    sub = await self._put_pooled(rk, rz, region, values=rv)
                    if sub is None:
                        sub = await self._put_placed(rk, rz, region, values=rv)
            for i, v in zip(rest, sub):
                ok[i] = v
        self.stats["puts"] += sum(ok)
        self.stats["put_failed"] += len(ok) - sum(ok)
        return ok

    def _stage(self, nbytes: int) -> tuple[memoryview, int]:
        if self._staging is None or len(self._staging) < nbytes:
            if self._staging_region >= 0:
                self.te.unregister(self._staging_region)
            size = max(nbytes, self._staging_min, 2 * len(self._staging or b""))
            self._staging = bytearray(size)
            self._staging_region = self.te.register(self._staging)
        return memoryview(self._staging), self._staging_region

    @property
    def _staging_view(self) -> memoryview:
        return memoryview(self._staging)

    async def exists(self, keys: bytes | Sequence[bytes]) -> bool | list[bool]:
        """One key -> bool; a list of keys -> one bool per key."""
        single = isinstance(keys, (bytes, bytearray))
        ks = check_keys([keys] if single else keys)
        r = await self._exists(ks, True)
        present = r[1] if r is not None else [False] * len(ks)
        return present[0] if single else present

    async def prefix_len(self, chain: Sequence[bytes]) -> int:
        """How many blocks of a hash chain, from the first, the store holds."""
        r = await self._exists(check_keys(chain), False)
        return r[0] if r is not None else 0

    async def remove(self, keys: bytes | Sequence[bytes]) -> int:
        ks = check_keys([keys] if isinstance(keys, (bytes, bytearray)) else keys)
        self._where.forget(ks)
        body = await self._fast_call(wire.REMOVE, wire.pack_keys(ks))
        if body is not False:
            return 0 if body is None else wire.unpack_count(body)
        resp = await self._call("Remove", pb.RemoveRequest(hashes=ks))
        return resp.removed if resp is not None else 0

    async def pin(self, keys: Sequence[bytes], on: bool = True) -> int:
        """Soft pin (e.g. a system prompt's blocks): evicted only after unpinned ones."""
        req = pb.PinRequest(hashes=check_keys(keys))
        resp = await self._call("Pin" if on else "Unpin", req)
        return resp.pinned if resp is not None else 0
