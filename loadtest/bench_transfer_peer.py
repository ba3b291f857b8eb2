"""The peer process of :mod:`kvmesh.loadtest.bench_transfer` (``--peer``): a transfer
engine owning the remote region, and the plain-socket baseline's sink; and what both sides
of the benchmark share (sizes, the secret, peak RSS)."""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import struct
import sys
import threading
import zlib

import numpy as np

from kvmesh.rdma import TransferEngine

KiB, MiB = 1 << 10, 1 << 20
STREAM_BUF = 4 * MiB
SECRET = b"bench-secret"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _stream_conn(conn: socket.socket) -> None:
    """One baseline connection: per run, an 8-byte length, that many bytes received
    with recv_into into a buffer that keeps them all; a 1-byte ack (the sender's clock
    stops there), then the CRC-32 of what came, for the sender to check."""
    keep = bytearray()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            hdr = conn.recv(8, socket.MSG_WAITALL)
            if len(hdr) < 8:
                return
            size = struct.unpack("!Q", hdr)[0]
            if len(keep) != size:
                keep = bytearray(size)
            view, got = memoryview(keep), 0
            while got < size:
                n = conn.recv_into(view[got : got + min(size - got, STREAM_BUF)])
                if not n:
                    return
                got += n
            conn.sendall(b"k")
            conn.sendall(struct.pack("!I", zlib.crc32(keep)))


def _stream_sink(ls: socket.socket) -> None:
    """Plain-socket baseline server: a thread per connection (:func:`_stream_conn`)."""
    while True:
        try:
            conn, _ = ls.accept()
        except OSError:
            return
        threading.Thread(target=_stream_conn, args=(conn,), daemon=True).start()


async def peer_main(total: int, conns: int, chunk: int) -> None:
    eng = TransferEngine(SECRET, conns_per_peer=conns, chunk_bytes=chunk)
    await eng.start()
    region = np.zeros(total, dtype=np.uint8)
    rid = eng.register(region)
    ls = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_stream_sink, args=(ls,), daemon=True).start()
    print(
        json.dumps({"address": eng.address, "region": rid, "stream_port": ls.getsockname()[1]}),
        flush=True,
    )
    await asyncio.to_thread(sys.stdin.read)  # until the parent closes stdin
    ls.close()
    await eng.close()
    print(json.dumps({"peak_rss_mib": peak_rss_mib()}), flush=True)
