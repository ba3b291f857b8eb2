"""kvmesh transfer engine: one-sided, batched, asynchronous KV-cache transfers
between registered memory regions, over RDMA verbs (:mod:`kvmesh.rdma.verbs`) when a
device is present and TCP (:mod:`kvmesh.rdma.tcp`) otherwise; see
:func:`kvmesh.rdma.factory.make_transport`."""

from .engine import Slice, Transfer, TransferEngine, TransferStatus
from .factory import make_transport
from .tcp import TcpTransport
from .transport import RegionTable, TransferError, Transport, WorkRequest, as_byte_view
from .verbs import VerbsTransport

__all__ = [
    "RegionTable",
    "Slice",
    "TcpTransport",
    "Transfer",
    "TransferEngine",
    "TransferError",
    "TransferStatus",
    "Transport",
    "VerbsTransport",
    "WorkRequest",
    "as_byte_view",
    "make_transport",
]
