"""RDMA verbs implementation of :class:`kvmesh.rdma.transport.Transport`.

Data path: WRITE/READ work requests become RC ``IBV_WR_RDMA_WRITE`` /
``IBV_WR_RDMA_READ`` work requests, cut into ``piece_bytes`` pieces and
striped over the queue pairs of the NICs preferred for the local memory
(the NICs on the memory's NUMA node, read from
``/sys/class/infiniband/<dev>/device/numa_node``; all NICs in device order
when none is near or the node is unknown).  One thread polls every NIC's
completion queue (never the event loop), completes pieces, and posts queued
pieces as send-queue slots free up (``qp_depth`` outstanding per QP).

Memory: each engine region is registered (``ibv_reg_mr``, local write +
remote read/write) once per NIC protection domain, lazily on first use or
when a peer asks for our table; regions that disappeared from the
:class:`~rdma.transport.RegionTable` are deregistered at the next sync.

Control channel: the embedded :class:`~rdma.tcp.TcpTransport` (same address,
same mutually-authenticated HMAC handshake) carries NOTIFYs as usual plus
connection-management messages: a NOTIFY whose payload starts with
:data:`CTL_MAGIC` is consumed by the transport, not delivered to the app.
Messages are JSON after the magic::

    hello   C->S {n: nonce, from: C address, nics: [{qp_num, lid, gid, psn}...]}
    welcome S->C {n, nics: [{qp_num, lid, gid, psn, nic}...], mrs, err?}
    mrs?    C->S {n, from}             mrs  S->C {n, mrs}
    mrs = {region id: [addr, length, [rkey per server NIC]]}

The client creates one QP per local NIC (RESET->INIT), sends ``hello``; the
server creates a QP per client QP on its NIC ``i % nics`` and brings it to
RTS, and answers ``welcome`` (to the client's engine address, which must be
reachable from the server) with its QP details and region table; the client
then moves its QPs INIT->RTR->RTS.  Each direction uses its own QPs.  NOTIFY
stays on TCP; the engine only sends it after the preceding writes completed.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from .gpu_memory import (
    GpuMemoryUnavailable,
    gpu_memory_mode,
    register_gpu_memory,
    unavailable_reason,
)
from .tcp import MAX_CONNS, TcpTransport
from .transport import Op, RegionTable, RemoteAccessError, TransferError, Transport, WorkRequest
from .verbs_layer import (
    LocalRegion,
    Peer,
    Pending,
    Piece,
    PyverbsLayer,
    VerbsLayer,
    memory_numa_node,
)

__all__ = ["CTL_MAGIC", "VerbsTransport"]

log = logging.getLogger(__name__)

CTL_MAGIC = b"\x00KVMESH-VERBS/1\x00"
_NEXT_STATE = {"RESET": "INIT", "INIT": "RTR", "RTR": "RTS"}


def _addr_of(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class _Reply:
    """The answer awaited by one control request (:meth:`VerbsTransport._request`)."""

    __slots__ = ("done", "msg")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.msg: dict[str, Any] | None = None


class _Nic:
    def __init__(self, index: int, name: str, numa: int) -> None:
        self.index, self.name, self.numa = index, name, numa
        self.ctx = self.pd = self.cq = None
        self.lid, self.gid, self.mtu = 0, "", 3
        self.outstanding = 0
        self.bytes_posted = 0


class _QP:
    """One RC queue pair and its send backlog; the state machine is enforced here."""

    def __init__(self, tr: VerbsTransport, nic: _Nic, peer: str) -> None:
        self.tr, self.nic, self.peer = tr, nic, peer
        self.handle = tr.layer.create_qp(nic.pd, nic.cq, tr.qp_depth)
        self.qp_num = self.handle.qp_num
        self.psn = int.from_bytes(os.urandom(3), "big")
        self.state = "RESET"
        self.remote_nic = 0
        self.lock = threading.Lock()
        self.outstanding = 0
        self.backlog: deque = deque()
        self.broken = False

    def info(self) -> dict:
        n = self.nic
        return {
            "qp_num": self.qp_num,
            "lid": n.lid,
            "gid": n.gid,
            "psn": self.psn,
            "nic": n.index,
            "mtu": n.mtu,
        }

    def move(self, state: str, **attrs) -> None:
        if _NEXT_STATE.get(self.state) != state and state != "ERR":
            raise RuntimeError(f"illegal QP transition {self.state} -> {state}")
        self.tr.layer.modify_qp(self.handle, state, **attrs)
        self.state = state

    def connect(self, remote: dict) -> None:
        """INIT (if needed) -> RTR -> RTS against ``remote``'s details."""
        nic, tr = self.nic, self.tr
        if self.state == "RESET":
            self.move("INIT", port=tr.port_num)
        self.move(
            "RTR",
            port=tr.port_num,
            dest_qp_num=remote["qp_num"],
            rq_psn=remote["psn"],
            dlid=remote["lid"],
            dgid=remote["gid"],
            gid_index=tr.gid_index,
            mtu=min(nic.mtu, remote.get("mtu", nic.mtu)),
        )
        self.move("RTS", sq_psn=self.psn)
        self.remote_nic = remote.get("nic", 0)


class VerbsTransport(Transport):
    """RDMA (RC queue pairs) data path + TCP control/notify channel.

    ``layer`` substitutes the verbs implementation (tests use a fake);
    ``devices`` restricts/orders the NICs used (default: all, in
    ``ibv_get_device_list`` order).
    """

    kind = "rdma"

    def __init__(
        self,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        conns_per_peer: int = 2,
        checksum: bool = False,
        connect_timeout: float = 3.0,
        max_conns: int = MAX_CONNS,
        layer: VerbsLayer | None = None,
        devices: list[str] | None = None,
        port_num: int = 1,
        gid_index: int | None = None,
        piece_bytes: int = 1 << 20,
        qp_depth: int = 128,
        cq_depth: int = 4096,
        gpu_memory: str | None = None,
    ) -> None:
        if checksum:
            raise ValueError("checksum=True is not supported by the RDMA transport")
        if piece_bytes < 1:
            raise ValueError("piece_bytes must be positive")
        self.tcp = TcpTransport(
            secret,
            host,
            port,
            conns_per_peer=conns_per_peer,
            connect_timeout=connect_timeout,
            max_conns=max_conns,
        )
        self.layer = layer if layer is not None else PyverbsLayer()
        # GPU memory registered through dma-buf: off by default, untested (gpu_memory.py)
        self.gpu_memory = gpu_memory_mode(gpu_memory)
        if self.gpu_memory != "off":
            why = unavailable_reason(self.gpu_memory, self.layer)
            if why is not None:
                raise GpuMemoryUnavailable(f"gpu_memory={self.gpu_memory!r}: {why}")
        # what a failed verbs operation (QP state machine included) or control exchange raises
        self._fails: tuple[type[Exception], ...] = (TransferError, RuntimeError, *self.layer.errors)
        self.device_names = devices
        self.port_num = port_num
        self.gid_index = (
            gid_index
            if gid_index is not None
            else int(os.environ.get("KVMESH_RDMA_GID_INDEX", "0"))
        )
        self.piece_bytes = piece_bytes
        self.qp_depth = qp_depth
        self.cq_depth = cq_depth
        self.connect_timeout = max(connect_timeout, 1.0) * 2
        self.address = ""
        self.closed = False
        self._nics: list[_Nic] = []
        self._regions: RegionTable | None = None
        self._on_notify: Callable[[bytes], None] | None = None
        self._lock = threading.Lock()  # peers, served QPs, replies
        self._mr_lock = threading.Lock()  # local region registrations
        self._plock = threading.Lock()  # Pending counters
        self._local: list[LocalRegion] = []  # sorted by start
        self._local_by_rid: dict[int, LocalRegion] = {}
        self._peers: dict[str, Peer] = {}
        self._served: dict[str, list[_QP]] = {}
        self._replies: dict[str, _Reply] = {}  # by nonce
        self._inflight: dict[int, Piece] = {}
        self._ids = itertools.count(1)
        self._wake = threading.Event()
        self._poller: threading.Thread | None = None
        self._counters = {
            "rdma_pieces": 0,
            "rdma_bytes_out": 0,
            "rdma_bytes_in": 0,
            "rdma_errors": 0,
            "rdma_handshakes": 0,
            "mr_registrations": 0,
        }

    # -- lifecycle ----------------------------------------------------------
    async def start(self, regions: RegionTable, on_notify: Callable[[bytes], None]) -> str:
        self._regions, self._on_notify = regions, on_notify
        found = self.layer.list_devices()
        if self.device_names:
            by_name = {d.name: d for d in found}
            missing = [n for n in self.device_names if n not in by_name]
            if missing:
                raise RuntimeError(f"RDMA devices not found: {missing}")
            found = [by_name[n] for n in self.device_names]
        if not found:
            raise RuntimeError("no RDMA device found")
        for i, d in enumerate(found):
            nic = _Nic(i, d.name, d.numa_node)
            nic.ctx = self.layer.open_device(d.name)
            pinfo = self.layer.query_port(nic.ctx, self.port_num, self.gid_index)
            if not pinfo.active:
                log.warning("RDMA device %s port %d is not active", d.name, self.port_num)
            nic.lid, nic.gid, nic.mtu = pinfo.lid, pinfo.gid, pinfo.mtu
            nic.pd = self.layer.alloc_pd(nic.ctx)
            nic.cq = self.layer.create_cq(nic.ctx, self.cq_depth)
            self._nics.append(nic)
        self.address = await self.tcp.start(regions, self._tcp_notify)
        self._poller = threading.Thread(
            target=self._poll_loop, daemon=True, name=f"kvmesh-cq-{self.tcp.port}"
        )
        self._poller.start()
        return self.address

    async def close(self) -> None:
        import asyncio

        if self.closed:
            return
        self.closed = True
        self._wake.set()
        if self._poller is not None:
            await asyncio.to_thread(self._poller.join, 5)
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
            served = [q for qs in self._served.values() for q in qs]
            self._served.clear()
            for slot in self._replies.values():
                slot.done.set()
        err = TransferError("transfer engine closed")
        for p in peers:
            with p.lock:
                waiting, p.waiting = p.waiting, []
            for r in waiting:
                r.complete(err)
            for qp in p.qps:
                with qp.lock:
                    backlog, qp.backlog = list(qp.backlog), deque()
                for piece in backlog:
                    self._piece_done(piece, err)
        for piece in list(self._inflight.values()):
            self._piece_done(piece, err)
        self._inflight.clear()
        destroy = self.layer.destroy
        for qp in [q for p in peers for q in p.qps] + served:
            destroy(qp.handle)
        for reg in self._local:
            for mr in reg.mrs:
                destroy(mr)
        for nic in self._nics:
            for obj in (nic.cq, nic.pd, nic.ctx):
                if obj is not None:
                    destroy(obj)
        await self.tcp.close()

    def stats(self) -> dict[str, int]:
        out = dict(self.tcp.stats())
        out.update(self._counters)
        for nic in self._nics:
            out[f"rdma_bytes_posted:{nic.name}"] = nic.bytes_posted
        return out

    # -- client side: submit ---------------------------------------------------
    def register_gpu_memory(self, addr: int, length: int, device_index: int = 0) -> list[Any]:
        """The hook for CUDA device memory: ``[addr, addr + length)`` registered through
        a dma-buf on every NIC's protection domain (one MR per NIC, in NIC order).
        Off by default and untested on hardware; refused with the reason
        (:class:`~rdma.gpu_memory.GpuMemoryUnavailable`) where it cannot work."""
        return [
            register_gpu_memory(self.layer, nic.pd, addr, length, self.gpu_memory, device_index)
            for nic in self._nics
        ]

    def submit(self, peer: str, requests: list[WorkRequest]) -> None:
        notifies = [r for r in requests if r.op is Op.NOTIFY]
        if notifies:
            self.tcp.submit(peer, notifies)
        data = [r for r in requests if r.op is not Op.NOTIFY]
        if not data:
            return
        if self.closed:
            for r in data:
                r.complete(TransferError("transfer engine closed"))
            return
        with self._lock:
            p = self._peers.get(peer)
            new = p is None
            if p is None:
                p = self._peers[peer] = Peer(peer)
        with p.lock:
            if not p.ready:
                p.waiting.extend(data)
                data = []
        if new:
            threading.Thread(
                target=self._connect, args=(p,), daemon=True, name=f"kvmesh-rdma-connect-{peer}"
            ).start()
        if data:
            self._post(p, data)

    def _connect(self, p: Peer) -> None:
        try:
            p.qps = [_QP(self, nic, p.address) for nic in self._nics]
            for qp in p.qps:
                qp.move("INIT", port=self.port_num)
            reply = self._request(
                p.address, {"t": "hello", "from": self.address, "nics": [q.info() for q in p.qps]}
            )
            if len(reply.get("nics", ())) != len(p.qps):
                raise TransferError("malformed RDMA handshake reply")
            for qp, remote in zip(p.qps, reply["nics"]):
                qp.connect(remote)
            p.mrs = self._parse_mrs(reply.get("mrs"))
            self._counters["rdma_handshakes"] += 1
        except self._fails as e:  # unreachable, TCP-only or closing peer; a verbs failure
            msg = f"RDMA connection to {p.address} failed: {e}"
            log.warning("%s", msg)
            self._drop_peer(p, msg)
            return
        except Exception as e:  # the thread's top: a bug (or a malformed reply) must still
            # drop the peer, or everything submitted to it would wait forever
            log.exception("RDMA connection to %s crashed", p.address)
            self._drop_peer(p, f"RDMA connection to {p.address} failed: {e!r}")
            return
        with p.lock:
            p.ready = True
            waiting, p.waiting = p.waiting, []
        if waiting:
            self._post(p, waiting)

    def _drop_peer(self, p: Peer, msg: str) -> None:
        """Forget ``p`` (the next submit reconnects) and fail what waits on it."""
        with self._lock:
            if self._peers.get(p.address) is p:
                del self._peers[p.address]
        with p.lock:
            p.failed = msg
            p.ready = False
            waiting, p.waiting = p.waiting, []
        for r in waiting:
            r.complete(TransferError(msg))

    def _post(self, p: Peer, reqs: list[WorkRequest], refreshed: bool = False) -> None:
        unknown: list[WorkRequest] = []
        touched: set[_QP] = set()
        piece_bytes = self.piece_bytes
        for r in reqs:
            remote = p.mrs.get(r.region)
            if remote is None:
                if refreshed:
                    r.complete(
                        TransferError(
                            f"peer {p.address}: {r.op.name} rejected: unknown region {r.region}"
                        )
                    )
                else:
                    unknown.append(r)
                continue
            raddr, rsize, rkeys = remote
            if r.offset < 0 or r.offset + r.length > rsize:
                r.complete(
                    TransferError(
                        f"peer {p.address}: {r.op.name} rejected: out of bounds: region "
                        f"{r.region} has {rsize} bytes, access [{r.offset}, "
                        f"{r.offset + r.length})"
                    )
                )
                continue
            if r.length == 0:
                r.complete(None)
                continue
            laddr = _addr_of(cast(memoryview, r.local))  # WRITE/READ: a region view
            reg = self._local_region(laddr, r.length)
            if reg is None:
                r.complete(TransferError("local memory is not in a registered region"))
                continue
            qps = self._preferred_qps(p, reg)
            n = -(-r.length // piece_bytes)
            pend = Pending(r, n)
            start = p.rr
            p.rr += n
            for k in range(n):
                qp = qps[(start + k) % len(qps)]
                off = k * piece_bytes
                ln = min(piece_bytes, r.length - off)
                piece = Piece(
                    pend,
                    qp,
                    r.op.name,
                    laddr + off,
                    ln,
                    reg.mrs[qp.nic.index].lkey,
                    raddr + r.offset + off,
                    rkeys[qp.remote_nic],
                )
                with qp.lock:
                    qp.backlog.append(piece)
                touched.add(qp)
        for qp in touched:
            self._pump(qp)
        if unknown:
            threading.Thread(target=self._refresh_and_post, args=(p, unknown), daemon=True).start()

    def _refresh_and_post(self, p: Peer, reqs: list[WorkRequest]) -> None:
        try:
            reply = self._request(p.address, {"t": "mrs?", "from": self.address})
            p.mrs = self._parse_mrs(reply.get("mrs"))
        except TransferError as e:  # no answer, an error answer or a malformed table
            for r in reqs:
                r.complete(TransferError(f"cannot fetch regions of {p.address}: {e}"))
            return
        self._post(p, reqs, refreshed=True)

    def _preferred_qps(self, p: Peer, reg: LocalRegion) -> list[_QP]:
        if reg.numa >= 0:
            near = [q for q in p.qps if q.nic.numa == reg.numa]
            if near:
                return near
        return p.qps

    def _pump(self, qp: _QP) -> None:
        """Post backlog pieces while the QP and its NIC's CQ have room."""
        failed: list[tuple[Piece, Exception]] = []
        with qp.lock:
            nic = qp.nic
            while qp.backlog and qp.outstanding < self.qp_depth and nic.outstanding < self.cq_depth:
                piece = qp.backlog.popleft()
                if qp.broken:
                    failed.append(
                        (piece, TransferError(f"RDMA queue pair to {qp.peer} is in error state"))
                    )
                    continue
                wr_id = next(self._ids)
                self._inflight[wr_id] = piece
                try:
                    self.layer.post_send(
                        qp.handle,
                        wr_id,
                        piece.op,
                        piece.laddr,
                        piece.length,
                        piece.lkey,
                        piece.raddr,
                        piece.rkey,
                    )
                except self.layer.errors as e:
                    self._inflight.pop(wr_id, None)
                    failed.append((piece, TransferError(f"post_send failed: {e}")))
                    continue
                qp.outstanding += 1
                nic.outstanding += 1
                nic.bytes_posted += piece.length
        if qp.outstanding:
            self._wake.set()
        for piece, err in failed:
            self._piece_done(piece, err)

    def _piece_done(self, piece: Piece, error: Exception | None) -> None:
        pend = piece.pending
        with self._plock:
            if error is not None and pend.error is None:
                pend.error = error
            pend.left -= 1
            last = pend.left == 0
        if last:
            pend.wr.complete(pend.error)

    # -- completion polling -------------------------------------------------------
    def _poll_loop(self) -> None:
        idle = 0
        while not self.closed:
            got = 0
            for nic in self._nics:
                try:
                    comps = self.layer.poll_cq(nic.cq, 64)
                except Exception:  # the poller must never die: every transfer waits on it
                    log.exception("poll_cq failed on %s", nic.name)
                    comps = []
                got += len(comps)
                touched = set()
                for c in comps:
                    piece = self._inflight.pop(c.wr_id, None)
                    if piece is None:
                        continue
                    qp = piece.qp
                    with qp.lock:
                        qp.outstanding -= 1
                        nic.outstanding -= 1
                    err = None
                    if c.status != 0:
                        self._counters["rdma_errors"] += 1
                        qp.broken = True
                        err = TransferError(
                            f"RDMA {piece.op} to {qp.peer} failed on {nic.name}: {c.message}"
                        )
                        p = self._peers.get(qp.peer)
                        if p is not None and qp in p.qps:
                            self._drop_peer(p, str(err))
                    else:
                        key = "rdma_bytes_out" if piece.op == "WRITE" else "rdma_bytes_in"
                        self._counters[key] += piece.length
                        self._counters["rdma_pieces"] += 1
                    self._piece_done(piece, err)
                    touched.add(qp)
                for qp in touched:
                    self._pump(qp)
            if got:
                idle = 0
            elif self._inflight:
                idle += 1
                time.sleep(0 if idle < 100 else 0.0002)  # busy-ish poll, yield GIL
            else:
                self._wake.clear()
                if not self._inflight:
                    self._wake.wait(0.05)

    # -- local memory registration ---------------------------------------------------
    def _sync_local(self) -> None:
        regions = self._regions
        assert regions is not None
        with self._mr_lock:
            live = set(regions.ids())
            for rid in [r for r in self._local_by_rid if r not in live]:
                reg = self._local_by_rid.pop(rid)
                self._local.remove(reg)
                for mr in reg.mrs:
                    self.layer.destroy(mr)
            for rid in sorted(live - set(self._local_by_rid)):
                try:
                    size = regions.size(rid)
                    view = regions.view(rid, 0, size)
                except (KeyError, RemoteAccessError):  # unregistered meanwhile
                    continue
                if size == 0:
                    continue
                addr = _addr_of(view)
                mrs = [self.layer.reg_mr(nic.pd, addr, size) for nic in self._nics]
                self._counters["mr_registrations"] += len(mrs)
                reg = LocalRegion(rid, addr, addr + size, mrs, memory_numa_node(addr))
                self._local_by_rid[rid] = reg
                bisect.insort(self._local, reg, key=lambda x: x.start)

    def _find_local(self, addr: int, length: int) -> LocalRegion | None:
        local = self._local
        i = bisect.bisect_right(local, addr, key=lambda x: x.start) - 1
        if i >= 0 and local[i].start <= addr and addr + length <= local[i].end:
            return local[i]
        return None

    def _local_region(self, addr: int, length: int) -> LocalRegion | None:
        reg = self._find_local(addr, length)
        if reg is None:
            self._sync_local()
            reg = self._find_local(addr, length)
        return reg

    def _mr_table(self) -> dict:
        self._sync_local()
        with self._mr_lock:
            return {
                str(r.rid): [r.start, r.end - r.start, [mr.rkey for mr in r.mrs]]
                for r in self._local
            }

    @staticmethod
    def _parse_mrs(raw: Any) -> dict[int, tuple[int, int, list[int]]]:
        """A peer's region table from its control message; TransferError if malformed."""
        try:
            return {int(k): (int(v[0]), int(v[1]), [int(x) for x in v[2]]) for k, v in raw.items()}
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
            raise TransferError(f"malformed RDMA region table: {e!r}") from e

    # -- control channel ---------------------------------------------------------
    def _send_ctl(self, peer: str, msg: dict) -> None:
        payload = CTL_MAGIC + json.dumps(msg).encode()

        def sent(err: Exception | None) -> None:
            if err is not None:
                log.debug("control message to %s failed: %s", peer, err)
                slot = self._replies.get(msg.get("n", ""))
                if slot is not None and msg["t"] in ("hello", "mrs?"):
                    slot.msg = {"err": str(err)}
                    slot.done.set()

        self.tcp.submit(peer, [WorkRequest(Op.NOTIFY, payload, 0, 0, len(payload), sent)])

    def _request(self, peer: str, msg: dict) -> dict:
        nonce = os.urandom(12).hex()
        slot = _Reply()
        with self._lock:
            self._replies[nonce] = slot
        try:
            self._send_ctl(peer, dict(msg, n=nonce))
            reply = slot.msg if slot.done.wait(self.connect_timeout) else None
            if reply is None:
                raise TransferError(
                    f"no RDMA control reply from {peer} (peer closed, unreachable, or TCP-only?)"
                )
        finally:
            with self._lock:
                self._replies.pop(nonce, None)
        if reply.get("err"):
            raise TransferError(reply["err"])
        return reply

    def _tcp_notify(self, payload: bytes) -> None:
        if not payload.startswith(CTL_MAGIC):
            assert self._on_notify is not None
            self._on_notify(payload)
            return
        try:
            msg = json.loads(payload[len(CTL_MAGIC) :])
            kind = msg["t"]
            if kind in ("welcome", "mrs"):
                slot = self._replies.get(msg.get("n", ""))
                if slot is not None:
                    slot.msg = msg
                    slot.done.set()
            elif kind == "hello":
                self._on_hello(msg)
            elif kind == "mrs?":
                self._send_ctl(msg["from"], {"t": "mrs", "n": msg["n"], "mrs": self._mr_table()})
        except Exception:  # runs on a TCP server thread: a bad control message must not
            # drop the connection that carries the peer's notifies
            log.exception("bad RDMA control message")

    def _on_hello(self, msg: dict) -> None:
        peer = msg["from"]
        reply: dict = {"t": "welcome", "n": msg["n"]}
        qps: list[_QP] = []
        try:
            if self.closed:
                raise TransferError("peer engine closing")
            for i, remote in enumerate(msg["nics"]):
                qp = _QP(self, self._nics[i % len(self._nics)], peer)
                qps.append(qp)
                qp.connect(remote)
            reply["nics"] = [q.info() for q in qps]
            reply["mrs"] = self._mr_table()
        except self._fails + (KeyError, TypeError) as e:  # KeyError, TypeError: a malformed hello
            reply = {"t": "welcome", "n": msg["n"], "err": f"peer {self.address}: {e}"}
            for qp in qps:
                self.layer.destroy(qp.handle)
            qps = []
        with self._lock:
            old = self._served.pop(peer, [])
            if qps:
                self._served[peer] = qps
        for qp in old:  # the client reconnected: its old QPs are gone
            self.layer.destroy(qp.handle)
        self._send_ctl(peer, reply)
