"""Framing constants of the TCP transport's request/reply protocol, shared by the
client side (:mod:`kvmesh.rdma.tcp_channel`, :mod:`kvmesh.rdma.tcp_lane`) and the server side
(:mod:`kvmesh.rdma.tcp_server`).  The header layouts themselves (``REQ``/``REP``) live in
:mod:`kvmesh.rdma.wire`; the wire format is described in :mod:`kvmesh.rdma.tcp`, which re-exports
these names."""

F_CRC = 0x01  # request flag: payload / READ data carries a crc32
REPLY = 0x80  # reply kind byte
ST_OK, ST_BAD_ACCESS, ST_CHECKSUM, ST_BAD_REQUEST = 0, 1, 2, 3
MAX_NOTIFY_BYTES = 64 << 20  # largest NOTIFY payload (and fast-lane error text) accepted
POLL_BACKOFF = 16  # most waits that skip polling after busy-poll windows ran out
