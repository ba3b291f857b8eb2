"""The TCP transport's data port: accepting connections and authenticating them.

:func:`accept_loop` runs on one thread per transport (:meth:`TcpTransport.start
<kvmesh.rdma.tcp.TcpTransport.start>`). It accepts connections and drives every pending
handshake (:mod:`kvmesh.rdma.wire`) itself, non-blocking, from one selector; only a peer
that proved it knows the cluster secret gets a thread of its own
(:func:`kvmesh.rdma.tcp_server.serve`). So a client that never finishes its handshake
costs a socket for a while, never a thread, and:

- **deadline**: a handshake not finished within ``TcpEndpoint.handshake_s`` of the
  accept is closed, however the client paces its bytes (counted ``handshake_timeouts``);
- **cap**: at most ``TcpEndpoint.max_conns`` connections at once, pending handshakes and
  authenticated peers together. At the cap a new connection closes the oldest pending
  handshake to make room (a real peer finishes its handshake in one round trip, so a
  flood must outpace that to keep it out); when every slot is an authenticated peer, the
  new connection is closed at once. Both count ``conns_over_limit``;
- a client that fails authentication counts ``auth_rejected``, one that closes or
  breaks the connection mid-handshake ``handshake_errors``.

A node exports these counts on ``/metrics`` as ``kvmesh_data_port_refused_total``.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time

from .tcp_proto import TcpEndpoint
from .tcp_server import ServerState, serve
from .wire import CLIENT_PROOF_BYTES, AuthError, server_answer, server_hello

log = logging.getLogger("kvmesh.rdma.tcp")

MAX_CONNS = 1024  # default cap on a data port's connections (pending + authenticated)
WARN_EVERY_S = 10.0  # at most one over-limit warning per this many seconds
TICK_S = 0.5  # the loop wakes at least this often (deadlines, close)


class _Pending:
    """One connection in its handshake: the server's nonce, the client's proof so far,
    and when it must be done."""

    __slots__ = ("sock", "nonce", "proof", "got", "deadline")

    def __init__(self, sock: socket.socket, nonce: bytes, deadline: float) -> None:
        self.sock = sock
        self.nonce = nonce
        self.proof = bytearray(CLIENT_PROOF_BYTES)
        self.got = 0
        self.deadline = deadline


class _Acceptor:
    """The accept thread's state: the selector, the pending handshakes (oldest first)."""

    def __init__(self, tr: TcpEndpoint, server: ServerState) -> None:
        self.tr = tr
        self.server = server
        self.ls = server.listener
        self.ls.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.ls, selectors.EVENT_READ, None)
        self.pending: dict[socket.socket, _Pending] = {}  # insertion order = age
        self.resume_at = 0.0  # accepts paused until then (accept failed, e.g. EMFILE)
        self.warned_at = -1e9

    def run(self) -> None:
        tr = self.tr
        try:
            while not tr.closed:
                now = time.monotonic()
                if self.resume_at and now >= self.resume_at:
                    self.resume_at = 0.0
                    self.sel.register(self.ls, selectors.EVENT_READ, None)
                wait = TICK_S
                if self.pending:  # the oldest pending handshake's deadline comes first
                    wait = min(wait, next(iter(self.pending.values())).deadline - now)
                for key, _ in self.sel.select(max(0.0, wait)):
                    if tr.closed:
                        break
                    if key.data is None:
                        self.accept()
                    else:
                        self.advance(key.data)
                self.expire(time.monotonic())
        finally:
            for p in list(self.pending.values()):
                self.drop(p, "")
            self.sel.close()

    def accept(self) -> None:
        tr = self.tr
        while True:
            try:
                sock, _ = self.ls.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if tr.closed:
                    return
                # e.g. out of file descriptors: pause accepting rather than spin on it
                log.warning("data port %d: accept failed (%s); pausing accepts 1 s", tr.port, e)
                self.sel.unregister(self.ls)
                self.resume_at = time.monotonic() + 1.0
                return
            if self.server.count() + len(self.pending) >= tr.max_conns:
                if not self.pending:  # every slot is an authenticated peer
                    tr.counters.add("conns_over_limit")
                    sock.close()
                    self.warn_over_limit()
                    continue
                oldest = next(iter(self.pending.values()))
                self.drop(oldest, "conns_over_limit")
                self.warn_over_limit()
            self.start(sock)

    def start(self, sock: socket.socket) -> None:
        hello, nonce = server_hello()
        sock.setblocking(False)
        try:  # a fresh socket's send buffer takes the 36-byte hello whole
            if sock.send(hello) != len(hello):
                raise ConnectionError("short send of the handshake hello")
        except OSError:
            self.tr.counters.add("handshake_errors")
            sock.close()
            return
        p = _Pending(sock, nonce, time.monotonic() + self.tr.handshake_s)
        self.pending[sock] = p
        self.sel.register(sock, selectors.EVENT_READ, p)

    def advance(self, p: _Pending) -> None:
        """Reads what the client sent of its proof; once whole, checks it and hands the
        connection to a serving thread."""
        try:
            got = p.sock.recv_into(memoryview(p.proof)[p.got :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = 0
        if not got:
            self.drop(p, "handshake_errors")
            return
        p.got += got
        if p.got < CLIENT_PROOF_BYTES:
            return
        self.forget(p)
        try:
            answer = server_answer(self.tr.secret, p.nonce, bytes(p.proof))
        except AuthError:
            self.tr.counters.add("auth_rejected")
            p.sock.close()
            return
        self.hand_over(p, answer)

    def hand_over(self, p: _Pending, answer: bytes) -> None:
        tr, sock = self.tr, p.sock
        t = threading.Thread(
            target=serve,
            args=(tr, self.server, sock, answer, p.deadline),
            daemon=True,
            name=f"kvmesh-srv-{tr.port}",
        )
        if tr.closed or not self.server.add(sock, t):
            sock.close()
            return
        t.start()

    def expire(self, now: float) -> None:
        while self.pending:
            p = next(iter(self.pending.values()))
            if p.deadline > now:
                return
            self.drop(p, "handshake_timeouts")

    def forget(self, p: _Pending) -> None:
        del self.pending[p.sock]
        try:
            self.sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass

    def drop(self, p: _Pending, counter: str) -> None:
        """Closes a pending handshake, counting why (``counter``; "" = not counted)."""
        self.forget(p)
        if counter:
            self.tr.counters.add(counter)
        p.sock.close()

    def warn_over_limit(self) -> None:
        now = time.monotonic()
        if now - self.warned_at >= WARN_EVERY_S:
            self.warned_at = now
            log.warning(
                "data port %d: %d connections at once already (the limit, --te-max-conns); "
                "closing pending handshakes or new connections "
                '(kvmesh_data_port_refused_total{reason="limit"} counts them)',
                self.tr.port,
                self.tr.max_conns,
            )


def accept_loop(tr: TcpEndpoint, server: ServerState) -> None:
    """Accepts and authenticates connections until the transport closes (see the module
    docstring); each authenticated one is served by a :func:`serve` thread."""
    _Acceptor(tr, server).run()
