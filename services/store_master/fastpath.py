"""The store-master's raw-TCP control path (framing in :mod:`kvmesh.services.store_master.wire`).

Served alongside gRPC on the same event loop and the same :class:`StoreMetadata`, so the
two paths see one state. A hot call whose answer needs no I/O (the usual case) is
answered inside ``data_received``, without a task; one that must first promote a block
from SSD or spill victims to make room runs as a task, and its answer may overtake
earlier ones (responses carry the request id). Served only when gRPC runs without TLS:
it has no authentication of its own, like plaintext gRPC.

The loop drives the connections' non-blocking sockets itself (not asyncio transports)
so that, after answering, it can busy-poll for the next call (``fast_poll_us``; see
:class:`FastPathServer`); the client end (:mod:`kvmesh.services.store.fastconn`) polls for
its answer the same way.
"""

from __future__ import annotations

import asyncio
import logging
import select
import socket
import struct
import time
from collections.abc import Coroutine, Iterable
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.rdma.wire import PollBackoff
from kvmesh.services.store_master import wire
from kvmesh.services.store_master.metadata import Block, Replica, StoreMetadata
from kvmesh.services.store_master.validation import MAX_HASHES, check_keys
from kvmesh.services.store_master.wire import HEAD, split_frames

log = logging.getLogger(__name__)
_RECV_BYTES = 256 << 10
POLL_BACKOFF = 16  # most answers that start no spin after spins in which no call came
# After a call that placed or located this many block bytes the client is busy copying
# or transferring them for longer than a poll window: answering it starts no spin.
QUIET_BYTES = 1 << 20

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

    def __init__(self, servicer: Backend) -> None:
        self.s = servicer
        self.buf = bytearray()
        self.t: _Shim | None = None
        self.moved = 0  # block bytes the last call placed or located

    def data_received(self, data: bytes) -> None:
        frames, oversized = split_frames(self.buf, data)
        out: list[bytes] = []
        for rid, method, body in frames:
            self.moved = 0
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
            log.warning("fast path: oversized frame; closing")
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
            if err := check_keys(keys, "GetReplicas"):
                return _INVALID, err.encode()
            if cand := s.needs_promotion(keys, any_order):
                return self._get_slow(keys, node, any_order, cand)
            return 0, self._get_resp(keys, node, any_order)
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

    def _get_resp(self, keys: list[bytes], node: str, any_order: bool) -> bytes:
        got, until = self.s.get_now(keys, node, any_order)
        items, i = [], 0
        for blk, rep in got:
            while keys[i] != blk.hash:
                i += 1
            items.append((i, rep.segment, rep.offset, blk.size))
            self.moved += blk.size
            i += 1
        return wire.pack_get_resp(int(self.s.meta.lease_s * 1000), items)

    async def _get_slow(
        self, keys: list[bytes], node: str, any_order: bool, cand: list[Block]
    ) -> _Answer:
        await self.s.promote(cand)
        return 0, self._get_resp(keys, node, any_order)

    async def _put_local_slow(self, need: int, args: tuple) -> _Answer:
        await self.s.run_eviction(need)
        status, reserved = self.s.put_local_plain(*args)
        return 0, wire.pack_put_local_resp(status, reserved)

    async def _pb(self, fn, req: Message) -> _Answer:
        resp = await fn(req, _Context())
        return 0, resp.SerializeToString()


class _Shim:
    """The transport face a :class:`FastPathProtocol` writes to: a non-blocking socket
    whose unsent bytes wait in ``out`` for a writer callback."""

    def __init__(self, server: FastPathServer, sock: socket.socket) -> None:
        self.server, self.sock, self.fd = server, sock, sock.fileno()
        self.out = bytearray()
        self.closed = False
        self.eof = False  # the peer is done sending: close once ``out`` is flushed

    def write(self, data: bytes) -> None:
        if self.closed:
            return
        if self.out:
            self.out += data
            return
        try:
            n = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self.close()
            return
        if n < len(data):
            self.out += data[n:]
            self.server.loop.add_writer(self.fd, self._flush)

    def _flush(self) -> None:
        try:
            n = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        del self.out[:n]
        if not self.out:
            self.server.loop.remove_writer(self.fd)
            if self.eof:
                self.close()

    def finish(self) -> None:
        """The peer closed its side: answer what is queued, then close."""
        if not self.out:
            self.close()
            return
        self.eof = True
        self.server._stop_reading(self.fd)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.server._forget(self.fd)
            self.sock.close()


class FastPathServer:
    """Listens and drives every connection's non-blocking socket from the event loop.

    Busy polling (``poll_us``): after serving what a readable socket held, the loop
    keeps polling all fast-path sockets (its own ``epoll``, zero timeout) until
    ``poll_us`` passes without a request, at most ``SPIN_CAP_S`` in all, so a client's
    next call is answered without the loop's wake-up. A call that placed or located
    ``QUIET_BYTES`` of blocks starts no spin: its client is busy moving them; and a
    spin in which no call came makes later answers skip it for a while
    (``PollBackoff``). Meanwhile other loop work (gRPC, timers) waits at most
    ``SPIN_CAP_S``; ``poll_us=0`` never spins."""

    SPIN_CAP_S = 0.002

    def __init__(self, servicer: Backend, listener: socket.socket, poll_us: int) -> None:
        self.s = servicer
        self.loop = asyncio.get_running_loop()
        self.ls = listener
        self.poll_s = poll_us / 1e6
        self.conns: dict[int, tuple[_Shim, FastPathProtocol]] = {}
        self.ep = select.epoll() if self.poll_s > 0 and hasattr(select, "epoll") else None
        self.backoff = PollBackoff(POLL_BACKOFF)
        self._resume: asyncio.TimerHandle | None = None
        self.loop.add_reader(listener.fileno(), self._accept)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.ls.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: pause, do not spin
                log.warning("fast path: accept failed (%s); pausing accepts for 1 s", e)
                self.loop.remove_reader(self.ls.fileno())
                self._resume = self.loop.call_later(1.0, self._resume_accepts)
                return
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            shim = _Shim(self, sock)
            proto = FastPathProtocol(self.s)
            proto.t = shim
            self.conns[shim.fd] = (shim, proto)
            self.loop.add_reader(shim.fd, self._readable, shim.fd)
            if self.ep is not None:
                self.ep.register(shim.fd, select.EPOLLIN)

    def _resume_accepts(self) -> None:
        self._resume = None
        if self.ls.fileno() >= 0:
            self.loop.add_reader(self.ls.fileno(), self._accept)

    def _drain(self, fd: int) -> bool:
        item = self.conns.get(fd)
        if item is None:
            return False
        shim, proto = item
        got = False
        while not shim.closed:
            try:
                data = shim.sock.recv(_RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                shim.close()
                break
            if not data:
                shim.finish()
                break
            got = True
            proto.data_received(data)
        return got

    def _readable(self, fd: int) -> None:
        item = self.conns.get(fd)
        if item is None or not self._drain(fd) or self.ep is None:
            return
        if item[1].moved < QUIET_BYTES and self.backoff.should_poll():
            self._spin(self.ep)

    def _spin(self, ep: select.epoll) -> None:
        now = time.perf_counter()
        idle_until, cap = now + self.poll_s, now + self.SPIN_CAP_S
        served = False
        while now < cap:
            ready = ep.poll(0)
            now = time.perf_counter()
            if any([self._drain(fd) for fd, _ in ready]):
                idle_until, served = now + self.poll_s, True
            elif now > idle_until:
                break
        if served:
            self.backoff.caught()
        else:  # nobody was that quick: later answers skip polling for a while
            self.backoff.missed()

    def _stop_reading(self, fd: int) -> None:
        self.loop.remove_reader(fd)
        if self.ep is not None:
            try:
                self.ep.unregister(fd)
            except OSError:
                pass

    def _forget(self, fd: int) -> None:
        if self.conns.pop(fd, None) is not None:
            self.loop.remove_reader(fd)
            self.loop.remove_writer(fd)
            if self.ep is not None:
                try:
                    self.ep.unregister(fd)
                except OSError:
                    pass

    def close(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
        self.loop.remove_reader(self.ls.fileno())
        self.ls.close()
        for shim, _ in list(self.conns.values()):
            shim.close()
        if self.ep is not None:
            self.ep.close()


async def serve_fast_path(
    servicer: Backend, host: str, port: int = 0, poll_us: int = 200
) -> tuple[FastPathServer, str]:
    """Starts the listener; returns (server, "host:port")."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    ls = socket.socket(family, socket.SOCK_STREAM)
    try:
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((host, port))
        ls.listen(512)
        ls.setblocking(False)
    except BaseException:
        ls.close()
        raise
    return FastPathServer(servicer, ls, poll_us), f"{host}:{ls.getsockname()[1]}"
