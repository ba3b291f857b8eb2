"""The store-master's raw-TCP control path (framing in :mod:`kvmesh.services.store_master.wire`).

Served alongside gRPC on the same event loop and the same :class:`StoreMetadata`, so the
two paths see one state. A hot call whose answer needs no I/O (the usual case) is
answered inside ``data_received``, without a task; one that must first promote a block
from SSD or spill victims to make room runs as a task, and its answer may overtake
earlier ones (responses carry the request id). When gRPC runs TLS the path does too,
with the same certificate and CA (:func:`kvmesh.services.common.channels.ssl_server_context`:
mutual TLS when a CA is set), so a secure cluster keeps it; without TLS it has no
authentication of its own, like plaintext gRPC.

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
import ssl
import struct
import time
from collections.abc import Coroutine, Iterable
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.rdma.wire import PollBackoff
from kvmesh.services.common.channels import ssl_handshake
from kvmesh.services.common.metrics import (
    STORE_FAST_CALLS,
    STORE_FAST_OVER_LIMIT,
    STORE_FAST_REFUSED,
)
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
_RECV_BYTES = 256 << 10
POLL_BACKOFF = 16  # most answers that start no spin after spins in which no call came
# After a call that placed or located this many block bytes the client is busy copying
# or transferring them for longer than a poll window: answering it starts no spin.
QUIET_BYTES = 1 << 20
HANDSHAKE_S = 10.0  # a TLS client that has not finished its handshake by then is dropped
MAX_CONNS = 1024  # connections served or in their handshake at once; more are closed
MAX_HANDSHAKES = 64  # TLS handshakes pending at once (each may hold HANDSHAKE_S); more closed
# a non-blocking socket, plain or TLS, that has nothing more to give or take now
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)

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
        self.t: _Shim | None = None
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
        except _WOULD_BLOCK:
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
        except _WOULD_BLOCK:
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
    ``SPIN_CAP_S``; ``poll_us=0`` never spins.

    Limits: at most ``max_conns`` connections (served or in their TLS handshake) and
    ``max_handshakes`` pending TLS handshakes at once; a connection beyond either is
    closed as soon as it is accepted (counted in ``STORE_FAST_OVER_LIMIT``), so a flood
    of idle or half-open clients cannot exhaust the store-master's descriptors or
    memory. A client refused so falls back to gRPC, or connects again once slots free."""

    SPIN_CAP_S = 0.002

    def __init__(
        self,
        servicer: Backend,
        listener: socket.socket,
        poll_us: int,
        ssl_ctx: ssl.SSLContext | None = None,
        max_conns: int = MAX_CONNS,
        max_handshakes: int = MAX_HANDSHAKES,
    ) -> None:
        self.s = servicer
        self.max_conns, self.max_handshakes = max_conns, max_handshakes
        self._warned_at = -1e9  # last over-limit warning (one per 10 s at most)
        self.ssl = ssl_ctx  # TLS on every connection (handshake first) when set
        self._handshakes: set[asyncio.Task] = set()
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
            if len(self.conns) + len(self._handshakes) >= self.max_conns:
                self._over_limit(sock, "connections", self.max_conns)
                continue
            if self.ssl is not None and len(self._handshakes) >= self.max_handshakes:
                self._over_limit(sock, "handshakes", self.max_handshakes)
                continue
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            if self.ssl is None:
                self._serve(sock)
                continue
            try:
                tls = self.ssl.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except (OSError, ValueError) as e:
                log.warning("fast path: TLS setup failed: %s", e)
                sock.close()
                continue
            task = self.loop.create_task(self._handshake(tls))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    def _over_limit(self, sock: socket.socket, limit: str, n: int) -> None:
        STORE_FAST_OVER_LIMIT.labels(limit=limit).inc()
        sock.close()
        now = time.monotonic()
        if now - self._warned_at >= 10.0:
            self._warned_at = now
            log.warning(
                "fast path: %d %s at once already (the limit); closing new connections "
                "until some end (kvmesh_store_fast_over_limit_total counts them)",
                n,
                "connections" if limit == "connections" else "pending TLS handshakes",
            )

    async def _handshake(self, sock: ssl.SSLSocket) -> None:
        try:
            await ssl_handshake(sock, HANDSHAKE_S)
        except (OSError, TimeoutError) as e:  # ssl.SSLError is an OSError
            STORE_FAST_REFUSED.inc()
            log.warning("fast path: TLS handshake refused or failed: %s", e)
            sock.close()
            return
        except BaseException:
            sock.close()
            raise
        self._serve(sock)

    def _serve(self, sock: socket.socket) -> None:
        """Starts serving an accepted (and, under TLS, handshaken) connection."""
        shim = _Shim(self, sock)
        proto = FastPathProtocol(self.s, tls=self.ssl is not None)
        proto.t = shim
        self.conns[shim.fd] = (shim, proto)
        self.loop.add_reader(shim.fd, self._readable, shim.fd)
        if self.ep is not None:
            self.ep.register(shim.fd, select.EPOLLIN)
        # a TLS record read during the handshake may already hold the first call
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            self.loop.call_soon(self._readable, shim.fd)

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
            except _WOULD_BLOCK:
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
        for task in list(self._handshakes):
            task.cancel()
        if self._resume is not None:
            self._resume.cancel()
        self.loop.remove_reader(self.ls.fileno())
        self.ls.close()
        for shim, _ in list(self.conns.values()):
            shim.close()
        if self.ep is not None:
            self.ep.close()


async def serve_fast_path(
    servicer: Backend,
    host: str,
    port: int = 0,
    poll_us: int = 200,
    ssl_ctx: ssl.SSLContext | None = None,
    max_conns: int = MAX_CONNS,
    max_handshakes: int = MAX_HANDSHAKES,
) -> tuple[FastPathServer, str]:
    """Starts the listener (TLS on every connection with ``ssl_ctx``); returns
    (server, "host:port"). Limits as :class:`FastPathServer`."""
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
    return FastPathServer(
        servicer, ls, poll_us, ssl_ctx, max_conns, max_handshakes
    ), f"{host}:{ls.getsockname()[1]}"
