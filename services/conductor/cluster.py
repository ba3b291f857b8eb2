"""The conductor's view of the cluster: live nodes from etcd membership, parsed, grouped by
role and model fingerprint, with one reusable gRPC channel per node."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import grpc

from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common.channels import make_channel
from kvmesh.services.common.registry import Membership

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeInfo:
    """A node as registered in etcd (``nodes/<role>/<id>``)."""

    node_id: str
    role: str
    grpc: str
    raw: dict[str, Any]

    @property
    def model(self) -> str:
        return self.raw.get("model", "")

    @property
    def fingerprint(self) -> str:
        return self.raw.get("fingerprint", "")


class ClusterView:
    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self._channels: dict[str, grpc.aio.Channel] = {}

    def nodes(self, role: str | None = None) -> list[NodeInfo]:
        out = []
        for key, value in sorted(self.membership.nodes.items()):
            parts = key.rstrip("/").split("/")
            try:
                raw = json.loads(value)
            except (ValueError, TypeError):
                log.warning("ignoring node %s with unreadable registration", key)
                continue
            info = NodeInfo(parts[-1], parts[-2], raw.get("grpc", ""), raw)
            if role is None or info.role == role:
                out.append(info)
        return out

    def models(self) -> dict[str, list[str]]:
        """model name -> fingerprints served: a decode node is enough (it can prefill on
        the colocated route); prefill nodes only add capacity."""
        out: dict[str, list[str]] = {}
        for model, fp in sorted({(n.model, n.fingerprint) for n in self.nodes("decode")}):
            out.setdefault(model, []).append(fp)
        return out

    def channel(self, addr: str) -> grpc.aio.Channel:
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = make_channel(addr)
        return ch

    def prefill_stub(self, n: NodeInfo) -> pbg.PrefillNodeStub:
        return pbg.PrefillNodeStub(self.channel(n.grpc))

    def decode_stub(self, n: NodeInfo) -> pbg.DecodeNodeStub:
        return pbg.DecodeNodeStub(self.channel(n.grpc))

    def store_stub(self) -> pbg.StoreMasterStub | None:
        masters = self.nodes("store-master")
        return pbg.StoreMasterStub(self.channel(masters[0].grpc)) if masters else None

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
