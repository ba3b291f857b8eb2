"""The store-master's raw-TCP control path (framing in :mod:`services.store_master.wire`).

Served alongside gRPC on the same event loop and the same :class:`StoreMetadata`, so the
two paths see one state. A hot call whose answer needs no I/O (the usual case) is
answered inside ``data_received``, without a task; one that must first promote a block
from SSD or spill victims to make room runs as a task, and its answer may overtake
earlier ones (responses carry the request id). Served only when gRPC runs without TLS:
it has no authentication of its own, like plaintext gRPC.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from protos import kvmesh_pb2 as pb
from services.store_master import wire
from services.store_master.server import _check_hashes
from services.store_master.wire import HEAD, HEAD_SIZE, MAX_FRAME, set_nodelay

log = logging.getLogger(__name__)

_PB = {
    "PutStart": (pb.PutStartRequest, "PutStart"),
    "PutEnd": (pb.PutEndRequest, "PutEnd"),
    "Pin": (pb.PinRequest, "Pin"),
    "Unpin": (pb.PinRequest, "Unpin"),
    "Stats": (pb.StoreStatsRequest, "Stats"),
}
_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """Just enough of a grpc.aio context for the servicer's unary handlers."""

    async def abort(self, code, details=""):
        raise _Abort(code, details)


class FastPathProtocol(asyncio.Protocol):
    def __init__(self, servicer) -> None:
        self.s = servicer
        self.buf = bytearray()
        self.t: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.t = transport
        set_nodelay(transport)

    def connection_lost(self, exc) -> None:
        self.t = None

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        if buf:
            buf += data
            data = bytes(buf)
            buf.clear()
        pos, end = 0, len(data)
        out: list[bytes] = []
        while end - pos >= HEAD_SIZE:
            n, rid, method = HEAD.unpack_from(data, pos)
            if n > MAX_FRAME:
                log.warning("fast path: oversized frame (%d bytes); closing", n)
                self.t.close()
                return
            if end - pos - HEAD_SIZE < n:
                break
            body = data[pos + HEAD_SIZE:pos + HEAD_SIZE + n]
            pos += HEAD_SIZE + n
            try:
                r = self.call(method, body)
            except (ValueError, IndexError, UnicodeDecodeError) as e:
                r = (_INVALID, f"malformed request: {e}".encode())
            except Exception as e:  # never kill the connection over one call
                log.exception("fast path call %d failed", method)
                r = (_INTERNAL, str(e).encode())
            if isinstance(r, tuple):
                out.append(HEAD.pack(len(r[1]), rid, r[0]) + r[1])
            else:
                self.s._spawn(self._later(rid, r))
        if pos < end:
            buf += data[pos:]
        if out and self.t is not None:
            self.t.write(out[0] if len(out) == 1 else b"".join(out))

    async def _later(self, rid: int, coro) -> None:
        try:
            status, body = await coro
        except _Abort as e:
            status, body = e.code.value[0], e.details.encode()
        except Exception as e:
            log.exception("fast path call failed")
            status, body = _INTERNAL, str(e).encode()
        if self.t is not None:
            self.t.write(HEAD.pack(len(body), rid, status) + body)

    # -- calls -----------------------------------------------------------------------
    def call(self, method: int, body: bytes):
        """(status, body) now, or a coroutine returning it."""
        s = self.s
        if method == wire.GET:
            keys, node, any_order = wire.unpack_get(body)
            if err := _check(keys, "GetReplicas"):
                return _INVALID, err.encode()
            if cand := s._needs_promotion(keys, any_order):
                return self._get_slow(keys, node, any_order, cand)
            return 0, self._get_resp(keys, node, any_order)
        if method == wire.EXISTS:
            any_order = bool(body[0] & 1)
            keys, _ = wire.unpack_keys(body, 1)
            if err := _check(keys, "Exists"):
                return _INVALID, err.encode()
            if any_order:
                present = s.meta.present(keys)
                n = next((i for i, p in enumerate(present) if not p), len(present))
                return 0, wire._U32.pack(n) + bytes(present)
            return 0, wire._U32.pack(len(s.meta.prefix(keys)))
        if method == wire.PUT_LOCAL:
            node, region, keys, slots, rsize, rcount, rspare, release = \
                wire.unpack_put_local(body)
            req = pb.PutLocalRequest(node_id=node, region_id=region, hashes=keys,
                                     offsets=[o for o, _ in slots],
                                     sizes=[z for _, z in slots], reserve_size=rsize,
                                     reserve_count=rcount, reserve_spare=rspare,
                                     release_offsets=[o for o, _ in release],
                                     release_sizes=[z for _, z in release])
            if err := s._put_local_error(req):
                return _INVALID, err.encode()
            if rcount and s.meta.over_high(rsize * rcount):
                return self._put_local_slow(req)
            r = s._put_local_now(req)
            return 0, wire.pack_put_local_resp(list(r.status), list(r.reserved))
        if method == wire.REMOVE:
            keys, _ = wire.unpack_keys(body, 0)
            if err := _check(keys, "Remove"):
                return _INVALID, err.encode()
            return 0, wire._U32.pack(s.meta.remove(keys))
        i = method - wire.PB_BASE
        if 0 <= i < len(wire.PB_METHODS):
            cls, name = _PB[wire.PB_METHODS[i]]
            return self._pb(getattr(s, name), cls.FromString(body))
        return grpc.StatusCode.UNIMPLEMENTED.value[0], f"unknown method {method}".encode()

    def _get_resp(self, keys: list[bytes], node: str, any_order: bool) -> bytes:
        got, until = self.s._get_now(keys, node, any_order)
        items, i = [], 0
        for blk, rep in got:
            while keys[i] != blk.hash:
                i += 1
            items.append((i, rep.segment, rep.offset, blk.size))
            i += 1
        return wire.pack_get_resp(int(self.s.meta.lease_s * 1000), items)

    async def _get_slow(self, keys, node, any_order, cand):
        await self.s._promote(cand)
        return 0, self._get_resp(keys, node, any_order)

    async def _put_local_slow(self, req):
        await self.s.run_eviction(req.reserve_size * req.reserve_count)
        r = self.s._put_local_now(req)
        return 0, wire.pack_put_local_resp(list(r.status), list(r.reserved))

    async def _pb(self, fn, req):
        resp = await fn(req, _Context())
        return 0, resp.SerializeToString()


def _check(keys, name: str) -> str | None:
    return _check_hashes(keys, name)


async def serve_fast_path(servicer, host: str, port: int = 0):
    """Starts the listener; returns (server, "host:port")."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: FastPathProtocol(servicer), host, port,
                                      reuse_address=True)
    sock = server.sockets[0]
    return server, f"{host}:{sock.getsockname()[1]}"

