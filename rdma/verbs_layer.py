"""The "verbs layer" seam under :class:`kvmesh.rdma.verbs.VerbsTransport`.

:class:`VerbsLayer` is the small set of libibverbs operations the transport
needs (open_device / alloc_pd / reg_mr / create_cq / create_qp / modify_qp /
post_send / poll_cq ...).  :class:`PyverbsLayer` implements it with pyverbs
(Debian ``python3-pyverbs``); unit tests substitute an in-memory fake so the
slicing, queue-pair state machine and completion bookkeeping run without a
device.  pyverbs is found by appending ``/usr/lib/python3/dist-packages`` to
``sys.path`` (at the end, so pip-installed packages keep precedence) only
when this module first needs it; kvmesh never requires it.

Also here: NUMA helpers for the NIC topology preference.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
from dataclasses import dataclass
from typing import Any

from .transport import WorkRequest

__all__ = [
    "DeviceInfo",
    "PortInfo",
    "PyverbsLayer",
    "VerbsLayer",
    "Completion",
    "QP_STATES",
    "import_pyverbs",
    "memory_numa_node",
    "probe_devices",
]

DIST_PACKAGES = "/usr/lib/python3/dist-packages"
SYSFS_IB = "/sys/class/infiniband"
QP_STATES = ("RESET", "INIT", "RTR", "RTS", "ERR")


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    numa_node: int  # -1 when unknown


@dataclass(frozen=True)
class PortInfo:
    lid: int
    gid: str  # "xxxx:xxxx:...": 8 groups, all zero when the port has none
    active: bool
    mtu: int  # ibv_mtu enum value (1=256 ... 5=4096)


@dataclass(frozen=True)
class Completion:
    wr_id: int
    status: int  # 0 = success (IBV_WC_SUCCESS)
    message: str


class VerbsLayer:
    """What :class:`~rdma.verbs.VerbsTransport` needs from libibverbs.

    Handles returned by the layer are opaque to the transport except for
    ``mr.lkey``/``mr.rkey`` and ``qp.qp_num``.  ``errors`` names the exception types
    its operations raise when the verbs library fails (the transport catches those,
    nothing broader).
    """

    errors: tuple[type[Exception], ...] = (RuntimeError,)

    def list_devices(self) -> list[DeviceInfo]:
        raise NotImplementedError

    def open_device(self, name: str) -> Any:
        raise NotImplementedError

    def query_port(self, ctx: Any, port: int, gid_index: int) -> PortInfo:
        raise NotImplementedError

    def alloc_pd(self, ctx: Any) -> Any:
        raise NotImplementedError

    def reg_mr(self, pd: Any, addr: int, length: int) -> Any:
        raise NotImplementedError

    def create_cq(self, ctx: Any, depth: int) -> Any:
        raise NotImplementedError

    def create_qp(self, pd: Any, cq: Any, max_send_wr: int) -> Any:
        raise NotImplementedError

    def modify_qp(self, qp: Any, state: str, **attrs: Any) -> None:
        """``state`` is INIT (attrs: port), RTR (port, dest_qp_num, rq_psn,
        dlid, dgid, gid_index, mtu), RTS (sq_psn) or ERR."""
        raise NotImplementedError

    def post_send(
        self,
        qp: Any,
        wr_id: int,
        op: str,
        local_addr: int,
        length: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
    ) -> None:
        """``op`` is "WRITE" or "READ"; always signaled."""
        raise NotImplementedError

    def poll_cq(self, cq: Any, max_entries: int) -> list[Completion]:
        raise NotImplementedError

    def destroy(self, obj: Any) -> None:
        raise NotImplementedError


# -- pyverbs ---------------------------------------------------------------------
def import_pyverbs() -> Any:
    """Import pyverbs, looking in Debian's dist-packages too.  Raises RuntimeError
    when it is not installed (ImportError when it is but cannot load)."""
    try:
        import pyverbs  # noqa: F401
    except ImportError:
        added = DIST_PACKAGES not in sys.path and os.path.isdir(DIST_PACKAGES)
        if added:  # at the end: pip-installed packages keep precedence
            sys.path.append(DIST_PACKAGES)
        try:
            import pyverbs  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                f"pyverbs is not installed ({e}); apt-get install python3-pyverbs"
            ) from e
        finally:
            if added:  # pyverbs' submodules resolve through pyverbs.__path__
                sys.path.remove(DIST_PACKAGES)
    import pyverbs.device

    return pyverbs


def _sysfs_numa(name: str) -> int:
    try:
        with open(f"{SYSFS_IB}/{name}/device/numa_node") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def probe_devices() -> list[DeviceInfo]:
    """RDMA devices visible to libibverbs; returns [] when there is none.  Raises
    RuntimeError when pyverbs is missing or cannot list the devices (ImportError when
    it is installed but cannot load)."""
    layer = PyverbsLayer()
    try:
        return layer.list_devices()
    except layer.errors as e:
        raise RuntimeError(str(e) or repr(e)) from e


class PyverbsLayer(VerbsLayer):
    """:class:`VerbsLayer` over pyverbs; its operations raise ``PyverbsError``."""

    ACCESS = None  # filled lazily

    def __init__(self) -> None:
        import_pyverbs()
        import pyverbs.enums as e
        from pyverbs.pyverbs_error import PyverbsError

        self.e = e
        self.errors = (PyverbsError,)

    def list_devices(self) -> list[DeviceInfo]:
        from pyverbs.device import get_device_list
        from pyverbs.pyverbs_error import PyverbsError

        try:
            devs = get_device_list()
        except PyverbsError as ex:  # "Failed to get devices list" when none
            if "devices list" in str(ex):
                return []
            raise
        out = []
        for d in devs:
            name = d.name.decode() if isinstance(d.name, bytes) else str(d.name)
            out.append(DeviceInfo(name, _sysfs_numa(name)))
        return out

    def open_device(self, name: str) -> Any:
        from pyverbs.device import Context

        return Context(name=name)

    def query_port(self, ctx: Any, port: int, gid_index: int) -> PortInfo:
        attr = ctx.query_port(port)
        try:
            gid = str(ctx.query_gid(port, gid_index))
        except self.errors:  # IB ports may have no GID table entry
            gid = ":".join(["0000"] * 8)
        return PortInfo(attr.lid, gid, attr.state == self.e.IBV_PORT_ACTIVE, attr.active_mtu)

    def alloc_pd(self, ctx: Any) -> Any:
        from pyverbs.pd import PD

        return PD(ctx)

    def reg_mr(self, pd: Any, addr: int, length: int) -> Any:
        from pyverbs.mr import MR

        e = self.e
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        return MR(pd, length, access, address=addr)

    def create_cq(self, ctx: Any, depth: int) -> Any:
        from pyverbs.cq import CQ

        return CQ(ctx, depth, None, None, 0)

    def create_qp(self, pd: Any, cq: Any, max_send_wr: int) -> Any:
        from pyverbs.qp import QP, QPCap, QPInitAttr

        cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        return QP(pd, QPInitAttr(qp_type=self.e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=1))

    def modify_qp(self, qp: Any, state: str, **a: Any) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        e = self.e
        attr = QPAttr()
        if state == "INIT":
            attr.qp_state = e.IBV_QPS_INIT
            attr.pkey_index = 0
            attr.port_num = a["port"]
            attr.qp_access_flags = (
                e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
            )
            mask = e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS
        elif state == "RTR":
            attr.qp_state = e.IBV_QPS_RTR
            attr.path_mtu = a.get("mtu", e.IBV_MTU_1024)
            attr.dest_qp_num = a["dest_qp_num"]
            attr.rq_psn = a["rq_psn"]
            attr.max_dest_rd_atomic = 16
            attr.min_rnr_timer = 12
            dgid = a.get("dgid") or ""
            if dgid and dgid.replace(":", "").strip("0"):
                gr = GlobalRoute(dgid=GID(dgid), sgid_index=a.get("gid_index", 0), hop_limit=64)
                attr.ah_attr = AHAttr(dlid=a.get("dlid", 0), port_num=a["port"], is_global=1, gr=gr)
            else:
                attr.ah_attr = AHAttr(dlid=a["dlid"], port_num=a["port"])
            mask = (
                e.IBV_QP_STATE
                | e.IBV_QP_AV
                | e.IBV_QP_PATH_MTU
                | e.IBV_QP_DEST_QPN
                | e.IBV_QP_RQ_PSN
                | e.IBV_QP_MAX_DEST_RD_ATOMIC
                | e.IBV_QP_MIN_RNR_TIMER
            )
        elif state == "RTS":
            attr.qp_state = e.IBV_QPS_RTS
            attr.sq_psn = a["sq_psn"]
            attr.timeout, attr.retry_cnt, attr.rnr_retry = 14, 7, 7
            attr.max_rd_atomic = 16
            mask = (
                e.IBV_QP_STATE
                | e.IBV_QP_SQ_PSN
                | e.IBV_QP_TIMEOUT
                | e.IBV_QP_RETRY_CNT
                | e.IBV_QP_RNR_RETRY
                | e.IBV_QP_MAX_QP_RD_ATOMIC
            )
        elif state == "ERR":
            attr.qp_state = e.IBV_QPS_ERR
            mask = e.IBV_QP_STATE
        else:
            raise ValueError(f"unsupported QP state {state}")
        qp.modify(attr, mask)

    def post_send(
        self,
        qp: Any,
        wr_id: int,
        op: str,
        local_addr: int,
        length: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
    ) -> None:
        from pyverbs.wr import SGE, SendWR

        e = self.e
        opcode = e.IBV_WR_RDMA_WRITE if op == "WRITE" else e.IBV_WR_RDMA_READ
        wr = SendWR(
            wr_id=wr_id,
            opcode=opcode,
            num_sge=1,
            sg=[SGE(local_addr, length, lkey)],
            send_flags=e.IBV_SEND_SIGNALED,
        )
        wr.set_wr_rdma(rkey, remote_addr)
        qp.post_send(wr)

    def poll_cq(self, cq: Any, max_entries: int) -> list[Completion]:
        n, wcs = cq.poll(max_entries)
        out = []
        for wc in wcs[:n]:
            msg = "" if wc.status == 0 else f"wc status {wc.status} (vendor {wc.vendor_err})"
            out.append(Completion(wc.wr_id, wc.status, msg))
        return out

    def destroy(self, obj: Any) -> None:
        close = getattr(obj, "close", None)
        if close is not None:
            close()


# -- NUMA ------------------------------------------------------------------------
_MOVE_PAGES = {"x86_64": 279, "aarch64": 239, "ppc64le": 301}
_libc = None


def memory_numa_node(addr: int) -> int:
    """NUMA node holding the page at ``addr`` (via move_pages(2) query mode),
    or -1 when unknown (page not faulted in, non-Linux, seccomp...)."""
    global _libc
    nr = _MOVE_PAGES.get(platform.machine())
    if nr is None:
        return -1
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        page = addr & ~(os.sysconf("SC_PAGE_SIZE") - 1)
        pages = (ctypes.c_void_p * 1)(page)
        status = (ctypes.c_int * 1)(-1)
        rc = _libc.syscall(nr, 0, 1, pages, None, status, 0)
    except (OSError, AttributeError, ValueError):
        return -1
    return status[0] if rc == 0 and status[0] >= 0 else -1


# -- bookkeeping records of kvmesh.rdma.verbs.VerbsTransport (kept here for its size) --
class Pending:
    """A work request cut into ``left`` pieces still outstanding."""

    __slots__ = ("wr", "left", "error")

    def __init__(self, wr: WorkRequest, left: int) -> None:
        self.wr, self.left, self.error = wr, left, None


class Piece:
    """One piece of a :class:`Pending` request, posted on one QP."""

    __slots__ = ("pending", "qp", "op", "laddr", "length", "lkey", "raddr", "rkey")

    def __init__(self, *args) -> None:
        (
            self.pending,
            self.qp,
            self.op,
            self.laddr,
            self.length,
            self.lkey,
            self.raddr,
            self.rkey,
        ) = args


class LocalRegion:
    """One engine region as registered on every NIC (``mrs``, by NIC index)."""

    __slots__ = ("rid", "start", "end", "mrs", "numa")

    def __init__(self, *args) -> None:
        self.rid, self.start, self.end, self.mrs, self.numa = args


class Peer:
    """Client-side state for one peer address: its QPs and region table."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.lock = threading.Lock()
        self.ready = False
        self.failed: str | None = None
        self.waiting: list[WorkRequest] = []
        self.qps: list[Any] = []  # kvmesh.rdma.verbs._QP, one per NIC
        self.mrs: dict[int, tuple[int, int, list[int]]] = {}
        self.rr = 0
