"""Wire-level helpers for the TCP transport: frame structs, socket tuning,
exact send/receive loops, a buffered reply reader, thread-safe counters and
the mutual HMAC handshake.

Handshake (all fields fixed size; the server reveals nothing derived from the
secret until the client has proven it knows the secret)::

    S -> C : b"KVM1" | nonce_s (32)
    C -> S : HMAC(secret, "client" | nonce_s | nonce_c) (32) | nonce_c (32)
    S -> C : HMAC(secret, "server" | nonce_c | nonce_s) (32)   (or close)
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import socket
import struct
import threading
import time

__all__ = [
    "AuthError",
    "Counters",
    "REQ",
    "REP",
    "Reader",
    "client_handshake",
    "server_answer",
    "server_handshake",
    "server_hello",
    "LoopTurns",
    "PollBackoff",
    "configure_socket",
    "usable_cpus",
    "recv_exact",
    "recv_spin",
    "sendmsg_all",
    "split_address",
]

REQ = struct.Struct("!BBHIIQQQ")  # op flags rsv crc region req_id offset length
REP = struct.Struct("!BBHIQQ")  # kind status rsv crc req_id length

MAGIC = b"KVM1"
NONCE_BYTES = 32
MAC_BYTES = 32


class AuthError(Exception):
    """The peer failed (or refused) mutual authentication."""


def _mac(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, role + a + b, hashlib.sha256).digest()


_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)


def recv_exact(sock: socket.socket, view: memoryview) -> int:
    """``recv_into`` until ``view`` is full; ConnectionError on EOF.

    ``MSG_WAITALL`` lets the kernel fill the whole view in one system call on
    a blocking socket (one GIL round trip instead of one per TCP segment
    burst); a short return (signal, timeout socket) just loops."""
    n = len(view)
    pos = 0
    while pos < n:
        got = sock.recv_into(view[pos:] if pos else view, n - pos, _WAITALL)
        if not got:
            raise ConnectionError("connection closed by peer")
        pos += got
    return n


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers narrow)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class PollBackoff:
    """When to busy-poll. Poll while windows catch what they wait for; after a window
    that ran out, skip polling for the next 1, then 2, 4 ... up to ``cap`` waits while
    windows keep running out; a window that catches its message starts over. A peer
    that is always slow thus costs a poll window about every ``cap`` waits, and one
    that is usually quick loses little to an odd miss."""

    __slots__ = ("skip", "step", "cap")

    def __init__(self, cap: int = 16) -> None:
        self.skip = self.step = 0
        self.cap = cap

    def should_poll(self) -> bool:
        if self.skip:
            self.skip -= 1
            return False
        return True

    def caught(self) -> None:
        self.step = 0

    def missed(self) -> None:
        self.step = min(self.cap, self.step * 2 or 1)
        self.skip = self.step


class LoopTurns:
    """Bounds how long a task may run on answers caught by busy polling. Such an
    answer is ready before it is awaited, and awaiting a ready result never yields;
    :meth:`owed` says when the task should give the event loop a turn anyway
    (``await asyncio.sleep(0)``): at most every ``every_s`` seconds."""

    __slots__ = ("every_s", "last")

    def __init__(self, every_s: float = 0.0005) -> None:
        self.every_s = every_s
        self.last = 0.0

    def owed(self) -> bool:
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            return True
        return False


def recv_spin(sock: socket.socket, view: memoryview, poll_s: float) -> int:
    """Busy-polls ``view`` full with non-blocking ``recv_into`` until it is full or
    ``poll_s`` seconds pass without it filling; returns the bytes received (never
    blocks). ConnectionError on EOF."""
    n = len(view)
    pos = 0
    deadline = 0.0
    while pos < n:
        try:
            got = sock.recv_into(view[pos:] if pos else view, n - pos, _DONTWAIT)
        except BlockingIOError:
            now = time.perf_counter()
            if not deadline:
                deadline = now + poll_s
            elif now > deadline:
                break
            continue
        if not got:
            raise ConnectionError("connection closed by peer")
        pos += got
    return pos


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def sendmsg_all(sock: socket.socket, bufs: list) -> None:
    """Send every buffer in order with as few syscalls as possible.

    Buffers must be bytes-like with ``len() == nbytes`` (bytes, bytearray or
    ``"B"``-format memoryviews).  Nothing is copied; partial sends advance a
    memoryview into the buffer that was cut.
    """
    if len(bufs) == 1:
        sock.sendall(bufs[0])
        return
    bufs = list(bufs)
    i, n_bufs = 0, len(bufs)
    while i < n_bufs:
        sent = sock.sendmsg(bufs[i : i + 512])
        while sent:
            size = len(bufs[i])
            if sent >= size:
                sent -= size
                i += 1
            else:
                bufs[i] = memoryview(bufs[i])[sent:]
                sent = 0
        while i < n_bufs and not len(bufs[i]):
            i += 1


def configure_socket(sock: socket.socket, buf_bytes: int) -> None:
    """Low latency + big buffers + dead-peer detection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buf_bytes:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, buf_bytes)
            except OSError:
                pass
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", 10),
        ("TCP_KEEPINTVL", 5),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", 20_000),
    ):
        tcp_opt = getattr(socket, name, None)  # not every platform has all four
        if tcp_opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, tcp_opt, value)
            except OSError:
                pass


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad peer address {address!r}; expected host:port")
    return host.strip("[]"), int(port)


CLIENT_PROOF_BYTES = MAC_BYTES + NONCE_BYTES  # what the client sends in the handshake


def server_hello() -> tuple[bytes, bytes]:
    """The server's first handshake message and its nonce: ``(hello, nonce_s)``. With
    :func:`server_answer`, the server side without the I/O (the data port drives many
    handshakes from one thread, :mod:`kvmesh.rdma.tcp_accept`)."""
    nonce_s = os.urandom(NONCE_BYTES)
    return MAGIC + nonce_s, nonce_s


def server_answer(secret: bytes, nonce_s: bytes, proof: bytes) -> bytes:
    """Checks the client's ``proof`` (:data:`CLIENT_PROOF_BYTES`) against ``nonce_s``;
    returns the server's reply, or raises AuthError."""
    mac_c, nonce_c = proof[:MAC_BYTES], proof[MAC_BYTES:]
    if len(proof) != CLIENT_PROOF_BYTES or not hmac.compare_digest(
        mac_c, _mac(secret, b"client", nonce_s, nonce_c)
    ):
        raise AuthError("client failed authentication")
    return _mac(secret, b"server", nonce_c, nonce_s)


def server_handshake(sock: socket.socket, secret: bytes) -> None:
    """Authenticate a connecting client on a blocking socket; raises AuthError (caller
    closes)."""
    hello, nonce_s = server_hello()
    sock.sendall(hello)
    try:
        proof = _recv_bytes(sock, CLIENT_PROOF_BYTES)
    except ConnectionError as e:
        raise AuthError("client closed during handshake") from e
    sock.sendall(server_answer(secret, nonce_s, proof))


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Authenticate to a server and verify it knows the secret too."""
    try:
        hello = _recv_bytes(sock, len(MAGIC) + NONCE_BYTES)
    except ConnectionError as e:
        raise AuthError("server closed before handshake") from e
    if hello[: len(MAGIC)] != MAGIC:
        raise AuthError("peer is not a kvmesh transfer engine")
    nonce_s = hello[len(MAGIC) :]
    nonce_c = os.urandom(NONCE_BYTES)
    sock.sendall(_mac(secret, b"client", nonce_s, nonce_c) + nonce_c)
    try:
        mac_s = _recv_bytes(sock, MAC_BYTES)
    except ConnectionError as e:
        raise AuthError("peer rejected our credentials (wrong cluster secret?)") from e
    if not hmac.compare_digest(mac_s, _mac(secret, b"server", nonce_c, nonce_s)):
        raise AuthError("peer failed authentication (wrong cluster secret?)")


class Counters:
    """Thread-safe integer counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: collections.Counter[str] = collections.Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


class Reader:
    """Buffered reader for reply streams: small headers are parsed from a
    read-ahead buffer; bulk data goes straight into the destination view
    (only a read-ahead fragment, at most the small buffer size, is memcpy'd)."""

    def __init__(self, sock: socket.socket, size: int = 8 << 10) -> None:
        self.sock = sock
        self.buf = bytearray(size)
        self.mv = memoryview(self.buf)
        self.start = self.end = 0

    def _fill(self, n: int) -> None:
        if self.start + n > len(self.buf):  # compact
            k = self.end - self.start
            self.mv[:k] = self.mv[self.start : self.end]
            self.start, self.end = 0, k
        while self.end - self.start < n:
            got = self.sock.recv_into(self.mv[self.end :])
            if not got:
                raise ConnectionError("connection closed by peer")
            self.end += got

    def read_struct(self, st):
        self._fill(st.size)
        out = st.unpack_from(self.buf, self.start)
        self.start += st.size
        return out

    def read_bytes(self, n: int) -> bytes:
        out = bytearray(n)
        self.read_into(memoryview(out))
        return bytes(out)

    def read_into(self, dst: memoryview) -> None:
        n = len(dst)
        k = min(n, self.end - self.start)
        if k:
            dst[:k] = self.mv[self.start : self.start + k]
            self.start += k
        if k < n:
            recv_exact(self.sock, dst[k:])
