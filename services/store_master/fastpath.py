"""The store-master's raw-TCP control path (framing in :mod:`kvmesh.services.store_master.wire`,
each connection's calls in :mod:`kvmesh.services.store_master.fastcalls`; this module
listens and drives the sockets).

Served alongside gRPC on the same event loop and the same :class:`StoreMetadata`, so the
two paths see one state. A hot call whose answer needs no I/O (the usual case) is
answered inside ``data_received``, without a task; one that must first promote a block
from SSD or spill victims to make room runs as a task, and its answer may overtake
earlier ones (responses carry the request id). When gRPC runs TLS the path does too,
with the same certificate and CA (:func:`kvmesh.services.common.channels.ssl_server_context`:
mutual TLS when a CA is set, and then only for certificates whose role may make the
store's data calls: :data:`FAST_RPCS`), so a secure cluster keeps it; without TLS it has
no authentication of its own, like plaintext gRPC.

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
import time

from kvmesh.rdma.wire import PollBackoff
from kvmesh.services.common.channels import ssl_handshake
from kvmesh.services.common.metrics import STORE_FAST_OVER_LIMIT, STORE_FAST_REFUSED
from kvmesh.services.common.roles import may_call, refusal_message, roles_of_peercert
from kvmesh.services.store_master import wire
from kvmesh.services.store_master.fastcalls import Backend, FastPathProtocol

log = logging.getLogger(__name__)
_RECV_BYTES = 256 << 10
# reads of one connection per readable callback: a client that keeps its socket full (one
# huge frame, or frames without end) yields the loop to the others between batches
_READS_PER_TURN = 16
POLL_BACKOFF = 16  # most answers that start no spin after spins in which no call came
# After a call that placed or located this many block bytes the client is busy copying
# or transferring them for longer than a poll window: answering it starts no spin.
QUIET_BYTES = 1 << 20
HANDSHAKE_S = 10.0  # a TLS client that has not finished its handshake by then is dropped
MAX_CONNS = 1024  # connections served or in their handshake at once; more are closed
MAX_HANDSHAKES = 64  # TLS handshakes pending at once (each may hold HANDSHAKE_S); more closed
# the gRPC methods the path's calls stand for: under mutual TLS a connection is served only
# when its certificate's roles may call every one of them (services/common/roles.py)
FAST_RPCS = tuple(
    f"/kvmesh.v1.StoreMaster/{m}"
    for m in ("GetReplicas", "Exists", "PutLocal", "Remove", *wire.PB_METHODS)
)
# a non-blocking socket, plain or TLS, that has nothing more to give or take now
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


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
        if self.ssl is not None and self.ssl.verify_mode == ssl.CERT_REQUIRED:
            roles = roles_of_peercert(sock.getpeercert())
            denied = [m for m in FAST_RPCS if not may_call(m, roles)]
            if denied:  # its client then tries gRPC, and is refused there too
                STORE_FAST_REFUSED.inc()
                log.warning(
                    "fast path: refused a connection: %s", refusal_message(denied[0], roles)
                )
                sock.close()
                return
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
        for _ in range(_READS_PER_TURN):
            if shim.closed:
                break
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
        else:  # the turn's reads are used up; a TLS socket may hold decrypted bytes that
            # no readable event announces: come back for them after the others' turn
            if isinstance(shim.sock, ssl.SSLSocket) and not shim.closed and shim.sock.pending():
                self.loop.call_soon(self._drain, fd)
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
