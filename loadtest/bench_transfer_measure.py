"""The measuring side of :mod:`kvmesh.loadtest.bench_transfer`: every point (block size,
op, mode) over the kvmesh engine, interleaved repetition by repetition with Mooncake and
the plain-socket stream baseline (:class:`_Stream`), every byte moved verified."""

from __future__ import annotations

import asyncio
import socket
import statistics
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvmesh.loadtest.bench_transfer_mooncake import Mooncake
from kvmesh.loadtest.bench_transfer_peer import SECRET, STREAM_BUF, KiB, MiB, peak_rss_mib
from kvmesh.rdma import Slice, TransferEngine

BLOCKS = [64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
OPS = ("write", "read")
MODES = ("batched", "single")


class _Stream:
    """The baseline: ``conns`` TCP connections, each sending its share of ``src`` at
    once (a thread each, as the engine's connections run on threads)."""

    def __init__(self, port: int, src: np.ndarray, conns: int) -> None:
        total = len(src)
        step = -(-total // conns)
        self.shares = [memoryview(src[i : i + step]) for i in range(0, total, step)]
        self.crcs = [zlib.crc32(sh) for sh in self.shares]
        self.socks = []
        for _ in self.shares:
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks.append(s)
        self.pool = ThreadPoolExecutor(len(self.socks))
        self.total = total

    @staticmethod
    def _send(s: socket.socket, share: memoryview) -> None:
        s.sendall(struct.pack("!Q", len(share)))
        for i in range(0, len(share), STREAM_BUF):
            s.sendall(share[i : i + STREAM_BUF])
        if s.recv(1, socket.MSG_WAITALL) != b"k":
            raise RuntimeError("stream baseline: the sink did not ack")

    def once(self) -> float:
        """GB/s of one run (all connections at once); then checks every byte's CRC."""
        t0 = time.perf_counter()
        list(self.pool.map(self._send, self.socks, self.shares))
        secs = time.perf_counter() - t0
        for s, crc in zip(self.socks, self.crcs):
            got = struct.unpack("!I", s.recv(4, socket.MSG_WAITALL))[0]
            if got != crc:
                raise RuntimeError("stream baseline: the sink received other bytes")
        return self.total / secs / 1e9

    def close(self) -> None:
        self.pool.shutdown()
        for s in self.socks:
            s.close()


async def engine_rates(
    peer: dict,
    total: int,
    reps: int,
    conns: int,
    chunk: int,
    max_point_s: float,
    mc: Mooncake | None,
) -> dict:
    eng = TransferEngine(SECRET, conns_per_peer=conns, chunk_bytes=chunk)
    await eng.start()
    rng = np.random.default_rng(0)
    # two sources of different bytes (write repetitions alternate), and a buffer that
    # reads land in and write repetitions are read back into, to verify every byte
    srcs = [rng.integers(0, 256, size=total, dtype=np.uint8) for _ in range(2)]
    src_ids = [eng.register(a) for a in srcs]
    check = np.zeros(total, dtype=np.uint8)
    check_id = eng.register(check)
    held = 0  # which source the peer's region holds
    verified = 0
    addr, rrid = peer["address"], peer["region"]
    out: dict = {op: {m: {} for m in MODES} for op in OPS}
    mc_out: dict = {op: {m: {} for m in MODES} for op in OPS}
    rss: dict = {}
    stream_runs: list[float] = []
    stream = _Stream(peer["stream_port"], srcs[1], conns)

    async def verify(kind: str, nbytes: int) -> None:
        """After a repetition: every byte it moved is where it should be."""
        nonlocal verified
        if kind == "write":  # read back what was written
            check[:nbytes] = 0
            await eng.read(addr, [Slice(check_id, 0, rrid, 0, nbytes)])
        if not np.array_equal(check[:nbytes], srcs[held][:nbytes]):
            raise RuntimeError(f"{kind}: the bytes moved differ from the source")
        verified += nbytes

    mc_error = None
    try:
        # warm-up: open the connections and fault in both regions
        await eng.write(addr, [Slice(src_ids[0], 0, rrid, 0, total)])
        await eng.read(addr, [Slice(check_id, 0, rrid, 0, total)])
        stream.once()
        for bs in BLOCKS:
            n = max(1, total // bs)
            for kind in OPS:
                op = eng.write if kind == "write" else eng.read

                def slices_of(src_id: int, n=n, bs=bs) -> list[Slice]:
                    return [Slice(src_id, i * bs, rrid, i * bs, bs) for i in range(n)]

                async def batched(sl):
                    await op(addr, sl)
                    return n * bs

                async def single(sl):
                    t0, done = time.perf_counter(), 0
                    for s in sl:
                        await op(addr, [s])
                        done += s.length
                        if time.perf_counter() - t0 > max_point_s:
                            break
                    return done

                for mode, fn in (("batched", batched), ("single", single)):
                    rates, mc_rates = [], []

                    async def kv_rep():
                        nonlocal held
                        if kind == "write":  # the other pattern than the peer holds
                            which = 1 - held
                            sl = slices_of(src_ids[which])
                        else:
                            check.fill(0)
                            sl = slices_of(check_id)
                        t0 = time.perf_counter()
                        nbytes = await fn(sl)
                        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
                        if kind == "write":
                            # a partial (single-mode) write leaves the old pattern past
                            # nbytes: copy it forward so the peer holds one source
                            if nbytes < total:
                                await eng.write(
                                    addr,
                                    [Slice(src_ids[which], nbytes, rrid, nbytes, total - nbytes)],
                                )
                            held = which
                        await verify(kind, nbytes)

                    for rep in range(reps):
                        if mc is not None and mc_error is None and rep % 2:
                            try:
                                mc_rates.append(await asyncio.to_thread(mc.rep, bs, kind, mode))
                            except (RuntimeError, ValueError, OSError) as e:
                                mc_error = repr(e)
                        await kv_rep()
                        if mc is not None and mc_error is None and not rep % 2:
                            try:
                                mc_rates.append(await asyncio.to_thread(mc.rep, bs, kind, mode))
                            except (RuntimeError, ValueError, OSError) as e:
                                mc_error = repr(e)
                        stream_runs.append(await asyncio.to_thread(stream.once))
                    out[kind][mode][bs] = statistics.median(rates)
                    if mc_rates:
                        mc_out[kind][mode][bs] = statistics.median(mc_rates)
                    rss[(kind, mode, bs)] = peak_rss_mib()
        bw = eng.bandwidth(addr)
    finally:
        stream.close()
        await eng.close()
    return {
        "rates": out,
        "mooncake": mc_out,
        "mooncake_error": mc_error,
        "rss": rss,
        "bandwidth": bw,
        "stream_runs": stream_runs,
        "verified_bytes": verified,
    }
