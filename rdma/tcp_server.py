"""Server side of the TCP transport (:class:`kvmesh.rdma.tcp.TcpTransport`).

:meth:`TcpTransport.start` runs :func:`accept_loop` on a thread; it starts one
:func:`serve` thread per accepted connection, which authenticates the peer and then
serves its requests (:func:`serve_requests`): WRITE payloads are ``recv_into``'d
straight into the registered region, READ data goes out zero-copy from it, NOTIFY
payloads go to the transport's ``on_notify`` callback, and acks are coalesced into
few ``sendmsg`` s.  While it waits for the next request (or for a WRITE payload of
up to ``POLL_MAX_BYTES``) the thread busy-polls the socket for up to the transport's
``poll_s`` before it blocks (:func:`kvmesh.rdma.wire.recv_spin`), if one of the transport's
few spinner slots is free (at most ``TcpTransport.spinners`` threads spin at once,
however many connections there are) and its :class:`~rdma.wire.PollBackoff` agrees.

These functions work on the transport's server-side state (listener, region table,
live server sockets and threads, counters, the ``corrupt_next`` fault hook).
"""

from __future__ import annotations

import logging
import socket
import threading
import zlib
from typing import TYPE_CHECKING

from .tcp_proto import (
    F_CRC,
    MAX_NOTIFY_BYTES,
    POLL_BACKOFF,
    REPLY,
    ST_BAD_ACCESS,
    ST_CHECKSUM,
    ST_OK,
)
from .transport import Op, RemoteAccessError
from .wire import (
    REP,
    REQ,
    AuthError,
    PollBackoff,
    recv_exact,
    recv_spin,
    sendmsg_all,
    server_handshake,
)

if TYPE_CHECKING:
    from .tcp import TcpTransport

log = logging.getLogger("kvmesh.rdma.tcp")  # the transport's logger, as before the split

MAX_PENDING_ACKS = 64  # server flushes replies at least this often...
MAX_PENDING_REPLY_BYTES = 1 << 20  # ...or once this much READ data is queued
SCRATCH_BYTES = 64 << 10  # sink for the payload of a rejected WRITE
POLL_MAX_BYTES = 1 << 20  # WRITE payloads up to this size are busy-polled too


def accept_loop(tr: TcpTransport) -> None:
    """Accepts connections until the transport closes; one :func:`serve` thread each."""
    ls = tr._listener
    assert ls is not None
    while not tr.closed:
        try:
            sock, _ = ls.accept()
        except TimeoutError:
            continue
        except OSError:
            if tr.closed:
                break
            continue
        sock.setblocking(True)
        t = threading.Thread(
            target=serve, args=(tr, sock), daemon=True, name=f"kvmesh-srv-{tr.port}"
        )
        with tr._lock:
            if tr.closed:
                sock.close()
                break
            tr._server_socks.add(sock)
            tr._server_threads.add(t)
        t.start()


def serve(tr: TcpTransport, sock: socket.socket) -> None:
    """One accepted connection: handshake, then :func:`serve_requests` until it ends."""
    try:
        try:
            sock.settimeout(max(tr.connect_timeout, 1.0))
            server_handshake(sock, tr.secret)
            sock.settimeout(None)
        except (OSError, AuthError) as e:
            tr.counters.add("auth_rejected" if isinstance(e, AuthError) else "handshake_errors")
            return
        serve_requests(tr, sock)
    except (OSError, ConnectionError):
        pass  # peer went away
    except Exception:  # pragma: no cover - defensive
        log.exception("server connection crashed")
    finally:
        with tr._lock:
            tr._server_socks.discard(sock)
            tr._server_threads.discard(threading.current_thread())
        sock.close()


def serve_requests(tr: TcpTransport, sock: socket.socket) -> None:
    """Serves an authenticated peer's requests until it goes away (raises then)."""
    regions = tr._regions
    assert regions is not None and tr._on_notify is not None
    hdr = bytearray(REQ.size)
    hmv = memoryview(hdr)
    scratch = memoryview(bytearray(SCRATCH_BYTES))
    acks: list = []  # coalesced replies (acks, errors, READ data views)
    pending_out = 0  # READ bytes referenced by ``acks``
    counters = tr.counters
    poll_s = tr.poll_s
    spinners = tr.spinners
    backoff = PollBackoff(POLL_BACKOFF)  # waits for the next request
    payload_backoff = PollBackoff(POLL_BACKOFF)  # waits for a WRITE payload

    def error(rid: int, status: int, msg: str) -> None:
        data = msg.encode()
        acks.append(REP.pack(REPLY, status, 0, 0, rid, len(data)))
        acks.append(data)
        counters.add("requests_rejected")

    while True:
        # Header: try without blocking first; flush coalesced acks only
        # when the pipe is empty (or too many are pending).
        got = 0
        if acks:
            if len(acks) < MAX_PENDING_ACKS:
                try:
                    got = sock.recv_into(hmv, REQ.size, socket.MSG_DONTWAIT)
                    if got == 0:
                        return
                except BlockingIOError:
                    got = 0
            if got < REQ.size:
                sendmsg_all(sock, acks)
                acks.clear()
                pending_out = 0
        if got < REQ.size:
            if poll_s and backoff.should_poll() and spinners.acquire(blocking=False):
                try:  # the slot is held while spinning only, never while blocked
                    got += recv_spin(sock, hmv[got:], poll_s)
                finally:
                    spinners.release()
                if got < REQ.size:  # the window ran out: this peer is not that quick
                    backoff.missed()
                else:
                    backoff.caught()
            if got < REQ.size:
                recv_exact(sock, hmv[got:])
        op, flags, _, crc, region, rid, offset, length = REQ.unpack_from(hdr)

        if op == Op.WRITE:
            try:
                dst = regions.view(region, offset, length)
            except RemoteAccessError as e:
                left = length
                while left:
                    left -= recv_exact(sock, scratch[: min(left, SCRATCH_BYTES)])
                error(rid, ST_BAD_ACCESS, f"WRITE rejected: {e}")
                continue
            got = 0
            if (
                poll_s
                and length <= POLL_MAX_BYTES
                and payload_backoff.should_poll()
                and spinners.acquire(blocking=False)
            ):
                try:
                    got = recv_spin(sock, dst, poll_s)
                finally:
                    spinners.release()
                if got < length:  # a slow sender: its own back-off, not the headers'
                    payload_backoff.missed()
                else:
                    payload_backoff.caught()
            if got < length:
                recv_exact(sock, dst[got:] if got else dst)
            if flags & F_CRC and zlib.crc32(dst) != crc:
                error(
                    rid,
                    ST_CHECKSUM,
                    f"checksum mismatch in WRITE of {length} bytes to region "
                    f"{region} offset {offset}",
                )
                counters.add("checksum_failures")
                continue
            acks.append(REP.pack(REPLY, ST_OK, 0, 0, rid, 0))
            counters.add("bytes_served_in", length)
        elif op == Op.READ:
            try:
                src = regions.view(region, offset, length)
            except RemoteAccessError as e:
                error(rid, ST_BAD_ACCESS, f"READ rejected: {e}")
                continue
            rcrc = zlib.crc32(src) if flags & F_CRC else 0
            data = src
            if tr.corrupt_next and length:
                tr.corrupt_next = False
                data = bytearray(src)
                data[0] ^= 0xFF
            acks.append(REP.pack(REPLY, ST_OK, 0, rcrc, rid, length))
            acks.append(data)  # zero-copy: the region view itself
            pending_out += length
            if pending_out >= MAX_PENDING_REPLY_BYTES:
                sendmsg_all(sock, acks)
                acks.clear()
                pending_out = 0
            counters.add("bytes_served_out", length)
        elif op == Op.NOTIFY:
            if length > MAX_NOTIFY_BYTES:
                raise ConnectionError("notify payload too large")
            buf = bytearray(length)
            recv_exact(sock, memoryview(buf))
            if flags & F_CRC and zlib.crc32(buf) != crc:
                error(rid, ST_CHECKSUM, "checksum mismatch in NOTIFY payload")
                continue
            tr._on_notify(bytes(buf))
            acks.append(REP.pack(REPLY, ST_OK, 0, 0, rid, 0))
        else:
            raise ConnectionError(f"bad opcode {op}")  # unrecoverable framing
