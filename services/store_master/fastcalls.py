"""The store-master's raw-TCP calls: one connection's framing and the dispatch of each
call (framing and encodings in :mod:`kvmesh.services.store_master.wire`) to the same
:class:`StoreMetadata` and servicer cores (:class:`Backend`) as the gRPC calls, so both
paths see one state. A call whose answer needs no I/O is answered at once; one that must
first promote a block from SSD or evict to make room runs as a task and answers later
(responses carry the request id). The sockets, TLS, limits and busy polling are
:mod:`kvmesh.services.store_master.fastpath`'s.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Coroutine, Iterable
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common.metrics import STORE_FAST_CALLS
from kvmesh.services.store_master import wire
from kvmesh.services.store_master.metadata import Block, Replica, StoreMetadata
from kvmesh.services.store_master.validation import (
    MAX_HASHES,
    biggest_segment,
    check_keys,
    check_put_sizes,
)
from kvmesh.services.store_master.wire import HEAD, split_frames

log = logging.getLogger(__name__)

_Answer = tuple[int, bytes]  # (0 or a grpc.StatusCode value, body)
_PB: dict[str, tuple[type[Message], str]] = {
    "PutStart": (pb.PutStartRequest, "PutStart"),
    "PutEnd": (pb.PutEndRequest, "PutEnd"),
    "Pin": (pb.PinRequest, "Pin"),
    "Unpin": (pb.PinRequest, "Unpin"),
    "Stats": (pb.StoreStatsRequest, "Stats"),
}
_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


class Backend(Protocol):
    """What the fast path needs of the store-master's servicer (its gRPC methods
    ``PutStart``, ``PutEnd``, ``Pin``, ``Unpin`` and ``Stats`` too, looked up by name):
    the same metadata and the same cores as the gRPC calls, so both paths agree."""

    meta: StoreMetadata

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None: ...

    def needs_promotion(self, hashes: list[bytes], any_order: bool) -> list[Block]: ...

    async def promote(self, cand: list[Block]) -> None: ...

    def get_now(
        self, hashes: list[bytes], node_id: str, any_order: bool
    ) -> tuple[list[tuple[Block, Replica]], float]: ...

    def put_local_plain(
        self,
        node: str,
        region: int,
        items: Iterable[tuple[bytes, int, int]],
        rsize: int,
        rcount: int,
        rspare: int,
        release: Iterable[tuple[int, int]] = (),
    ) -> tuple[list[int], list[int]]: ...

    async def run_eviction(self, extra: int = 0) -> None: ...


class Transport(Protocol):
    """Where a :class:`FastPathProtocol` writes its answers (the fast path's socket
    face): ``write`` queues bytes, ``close`` ends the connection."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


def _peer(t: Transport) -> str:
    sock: Any = getattr(t, "sock", None)
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, AttributeError):  # gone already, or no socket to ask
        return "a client"
    return f"{host}:{port}"


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """Just enough of a grpc.aio context for the servicer's unary handlers."""

    async def abort(self, code, details=""):
        raise _Abort(code, details)


class FastPathProtocol:
    """One connection's framing and calls; ``t`` is where answers are written."""

    def __init__(self, servicer: Backend, tls: bool = False) -> None:
        self.s = servicer
        self.buf = bytearray()
        self.t: Transport | None = None
        self.moved = 0  # block bytes the last call placed or located
        self.calls = STORE_FAST_CALLS.labels(tls="true" if tls else "false")

    def data_received(self, data: bytes) -> None:
        frames, oversized = split_frames(self.buf, data)
        if frames:
            self.calls.inc(len(frames))
        out: list[bytes] = []
        # a store-master that does not lead (a standby, a leader cut off from etcd)
        # refuses every call here as its gRPC face does (StandbyGate): its metadata is
        # not the cluster's, and connections made while it led must not go on using it
        refusal = getattr(self.s, "refusal", None)
        why = refusal() if refusal is not None and frames else ""
        for rid, method, body in frames:
            self.moved = 0
            if why:
                out.append(HEAD.pack(len(why), rid, _UNAVAILABLE) + why.encode())
                continue
            try:
                r = self.call(method, body)
            except (ValueError, IndexError, UnicodeDecodeError, struct.error) as e:
                r = (_INVALID, f"malformed request: {e}".encode())
            except Exception as e:
                # a servicer boundary: a failed call becomes INTERNAL for its caller and
                # is logged; the connection and the other calls in this read live on
                log.exception("fast path call %d failed", method)
                r = (_INTERNAL, str(e).encode())
            if isinstance(r, tuple):
                out.append(HEAD.pack(len(r[1]), rid, r[0]) + r[1])
            else:
                self.s.spawn(self._later(rid, r))
        if out and self.t is not None:
            self.t.write(out[0] if len(out) == 1 else b"".join(out))
        if oversized and self.t is not None:
            log.warning(
                "fast path: a frame from %s declares %d bytes, past the protocol's maximum "
                "of %d; refused at its header, closing that connection",
                _peer(self.t),
                oversized,
                wire.MAX_FRAME,
            )
            self.t.close()

    async def _later(self, rid: int, coro: Coroutine[Any, Any, _Answer]) -> None:
        try:
            status, body = await coro
        except _Abort as e:
            status, body = e.code.value[0], e.details.encode()
        except Exception as e:
            # as in data_received: the caller gets INTERNAL, the task never dies silently
            log.exception("fast path call failed")
            status, body = _INTERNAL, str(e).encode()
        if self.t is not None:
            self.t.write(HEAD.pack(len(body), rid, status) + body)  # dropped once closed

    # -- calls -----------------------------------------------------------------------
    def call(self, method: int, body: bytes) -> _Answer | Coroutine[Any, Any, _Answer]:
        """(status, body) now, or a coroutine returning it."""
        s = self.s
        if method == wire.GET:
            keys, node, any_order = wire.unpack_get(body)
            if body[0] & ~(wire.GET_ANY_ORDER | wire.GET_GENS):
                return _INVALID, f"GetReplicas: unknown flags {body[0]:#x}".encode()
            if err := check_keys(keys, "GetReplicas"):
                return _INVALID, err.encode()
            if cand := s.needs_promotion(keys, any_order):
                return self._get_slow(keys, node, any_order, cand, wire.get_wants_gens(body))
            return 0, self._get_resp(keys, node, any_order, wire.get_wants_gens(body))
        if method == wire.EXISTS:
            keys, any_order = wire.unpack_exists(body)
            if err := check_keys(keys, "Exists"):
                return _INVALID, err.encode()
            if any_order:
                present = s.meta.present(keys)
                n = next((i for i, p in enumerate(present) if not p), len(present))
                return 0, wire.pack_exists_resp(n, present)
            return 0, wire.pack_exists_resp(len(s.meta.prefix(keys)), [])
        if method == wire.PUT_LOCAL:
            node, region, keys, slots, rsize, rcount, rspare, release = wire.unpack_put_local(body)
            if err := check_keys(keys, "PutLocal"):
                return _INVALID, err.encode()
            if len(keys) != len(slots):
                return _INVALID, b"PutLocal: one (offset, size) slot per key"
            if rcount + rspare > MAX_HASHES:
                return _INVALID, f"PutLocal: at most {MAX_HASHES} slots per call".encode()
            self.moved = sum(z for _, z in slots) + rsize * rcount  # copied in, or next
            args = (
                node,
                region,
                [(k, o, z) for k, (o, z) in zip(keys, slots)],
                rsize,
                rcount,
                rspare,
                release,
            )
            if rcount and s.meta.over_high(rsize * rcount):
                return self._put_local_slow(rsize * rcount, args)
            status, reserved = s.put_local_plain(*args)
            return 0, wire.pack_put_local_resp(status, reserved)
        if method == wire.PUT_START:
            node, keys, sizes = wire.unpack_put_start(body)
            if err := check_keys(keys, "PutStart") or check_put_sizes(
                sizes, biggest_segment(s.meta.segments.values()), "PutStart"
            ):
                return _INVALID, err.encode()
            total = sum(sizes)
            self.moved = total  # the client writes them next
            if s.meta.over_high(total):
                return self._put_start_slow(total, node, keys, sizes)
            return 0, self._put_start_resp(node, keys, sizes)
        if method == wire.PUT_RESERVE:
            node, size, count, spare = wire.unpack_put_reserve(body)
            if count == 0:
                return _INVALID, b"PutReserve: count must be >= 1 (spare slots come with one)"
            if count + spare > MAX_HASHES:
                return _INVALID, f"PutReserve: at most {MAX_HASHES} slots per call".encode()
            if err := check_put_sizes(
                [size], biggest_segment(s.meta.segments.values()), "PutReserve"
            ):
                return _INVALID, err.encode()
            self.moved = size * count  # the client writes into them next
            if s.meta.over_high(size * max(1, count)):  # make room as a PutStart would
                return self._reserve_slow(size * max(1, count), node, size, count, spare)
            return 0, self._reserve_resp(node, size, count, spare)
        if method == wire.PUT_SLOTS:
            node, region, keys, size, offs, tokens, refill = wire.unpack_put_slots(body)
            if err := check_keys(keys, "PutSlots"):
                return _INVALID, err.encode()
            if refill > MAX_HASHES:
                return _INVALID, f"PutSlots: at most {MAX_HASHES} slots per call".encode()
            self.moved = size * len(keys)
            status, token, new = s.meta.commit_remote(
                node, region, [(k, o, size, t) for k, o, t in zip(keys, offs, tokens)], refill
            )
            return 0, wire.pack_put_slots_resp(status, token, new)
        if method == wire.PUT_RELEASE:
            node, region, size, slots = wire.unpack_put_release(body)
            if len(slots) > MAX_HASHES:
                return _INVALID, f"PutRelease: at most {MAX_HASHES} slots per call".encode()
            return 0, wire.pack_count(s.meta.release_remote(node, region, size, slots))
        if method == wire.PUT_END:
            keys, abort = wire.unpack_put_end(body)
            if err := check_keys(keys, "PutEnd"):
                return _INVALID, err.encode()
            done, failed = s.meta.put_end_detail(keys, abort)
            bad = set(failed)
            idx = [] if abort else [i for i, k in enumerate(keys) if k in bad]
            return 0, wire.pack_put_end_resp(len(done), idx)
        if method == wire.REMOVE:
            keys, _ = wire.unpack_keys(body, 0)
            if err := check_keys(keys, "Remove"):
                return _INVALID, err.encode()
            return 0, wire.pack_count(s.meta.remove(keys))
        i = method - wire.PB_BASE
        if 0 <= i < len(wire.PB_METHODS):
            cls, name = _PB[wire.PB_METHODS[i]]
            return self._pb(getattr(s, name), cls.FromString(body))
        return grpc.StatusCode.UNIMPLEMENTED.value[0], f"unknown method {method}".encode()

    def _get_resp(self, keys: list[bytes], node: str, any_order: bool, gens: bool) -> bytes:
        got, until = self.s.get_now(keys, node, any_order)
        items, i = [], 0
        for blk, rep in got:
            while keys[i] != blk.hash:
                i += 1
            items.append((i, rep.segment, rep.offset, blk.size))
            self.moved += blk.size
            i += 1
        lease_ms = int(self.s.meta.lease_s * 1000)
        return wire.pack_get_resp(lease_ms, items, [r.gen for _, r in got] if gens else None)

    def _put_start_resp(self, node: str, keys: list[bytes], sizes: list[int]) -> bytes:
        placed, skipped = self.s.meta.put_start(node, keys, sizes)
        where = {k: i for i, k in enumerate(keys)}
        skip = set(skipped)
        present = [i for i, k in enumerate(keys) if k in skip]
        items = [
            (where[b.hash], b.replicas[0].segment, b.replicas[0].offset, b.size) for b in placed
        ]
        return wire.pack_put_start_resp(items, present)

    def _reserve_resp(self, node: str, size: int, count: int, spare: int) -> bytes:
        meta = self.s.meta
        seg, offs, token = meta.reserve_remote(node, size, count, spare)
        ttl = int(meta.put_timeout_s * 1000)
        if seg is None:
            return wire.pack_put_reserve_resp(ttl, 0, "", "", 0, [])
        return wire.pack_put_reserve_resp(
            ttl, seg.region_id, seg.data_address, seg.node_id, token, offs
        )

    async def _reserve_slow(
        self, need: int, node: str, size: int, count: int, spare: int
    ) -> _Answer:
        await self.s.run_eviction(need)
        return 0, self._reserve_resp(node, size, count, spare)

    async def _put_start_slow(
        self, need: int, node: str, keys: list[bytes], sizes: list[int]
    ) -> _Answer:
        await self.s.run_eviction(need)
        return 0, self._put_start_resp(node, keys, sizes)

    async def _get_slow(
        self, keys: list[bytes], node: str, any_order: bool, cand: list[Block], gens: bool
    ) -> _Answer:
        await self.s.promote(cand)
        return 0, self._get_resp(keys, node, any_order, gens)

    async def _put_local_slow(self, need: int, args: tuple) -> _Answer:
        await self.s.run_eviction(need)
        status, reserved = self.s.put_local_plain(*args)
        return 0, wire.pack_put_local_resp(status, reserved)

    async def _pb(self, fn, req: Message) -> _Answer:
        resp = await fn(req, _Context())
        return 0, resp.SerializeToString()
