"""What the TCP transport's modules share: the framing constants of its request/reply
protocol, used by the client side (:mod:`kvmesh.rdma.tcp_channel`, :mod:`kvmesh.rdma.tcp_lane`)
and the server side (:mod:`kvmesh.rdma.tcp_server`), and :class:`TcpEndpoint`, the part of
the transport those modules see.  The header layouts themselves (``REQ``/``REP``) live in
:mod:`kvmesh.rdma.wire`; the wire format is described in :mod:`kvmesh.rdma.tcp`, which
re-exports the constants."""

from __future__ import annotations

import threading
from typing import Protocol

from .wire import Counters

F_CRC = 0x01  # request flag: payload / READ data carries a crc32
REPLY = 0x80  # reply kind byte
ST_OK, ST_BAD_ACCESS, ST_CHECKSUM, ST_BAD_REQUEST = 0, 1, 2, 3
MAX_NOTIFY_BYTES = 64 << 20  # largest NOTIFY payload (and fast-lane error text) accepted
POLL_BACKOFF = 16  # most waits that skip polling after busy-poll windows ran out


class TcpEndpoint(Protocol):
    """The transport's settings and shared state as the channels, the fast lane and the
    server threads see them; :class:`kvmesh.rdma.tcp.TcpTransport` satisfies it.

    They only read it, except ``corrupt_next`` (the test-only fault hook: whichever side
    sends the damaged payload clears it).
    """

    secret: bytes  # cluster secret for the handshake
    port: int  # listening port (names the server threads)
    sock_buf_bytes: int  # SO_SNDBUF / SO_RCVBUF for new sockets
    connect_timeout: float  # seconds for connect + handshake
    handshake_s: float  # a server-side handshake not done this long after accept is closed
    max_conns: int  # most connections the data port holds at once (pending + served)
    checksum: bool  # crc32 every payload sent and check every one received
    poll_s: float  # busy-poll window in seconds (0 = never spin)
    spinners: threading.BoundedSemaphore  # slots for server threads that busy-poll
    counters: Counters
    closed: bool
    corrupt_next: bool
