"""kvmesh transfer engine: one-sided, batched, asynchronous KV-cache transfers
between registered memory regions (TCP transport today; the
:class:`~rdma.transport.Transport` interface is shaped for RDMA verbs)."""

from .engine import Slice, Transfer, TransferEngine, TransferStatus
from .tcp import TcpTransport
from .transport import RegionTable, Transport, TransferError, WorkRequest, as_byte_view

__all__ = [
    "RegionTable",
    "Slice",
    "TcpTransport",
    "Transfer",
    "TransferEngine",
    "TransferError",
    "TransferStatus",
    "Transport",
    "WorkRequest",
    "as_byte_view",
]
