"""What prefill and decode nodes share: a model replica, its KV pool registered with the
transfer engine, a DRAM segment lent to the store (mounted on every store-master that
joins), and counters reported by ``Status``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import torch

from protos import kvmesh_pb2 as pb
from protos import kvmesh_pb2_grpc as pbg
from rdma import TransferEngine
from services.common.config import parse_size
from services.common.hashing import model_fingerprint, preset_weights_digest
from services.common.registry import Membership, nodes_prefix
from services.common.service import Service
from services.common.settings import NodeConfig
from services.engine.config import PRESETS, dtype_name, resolve_dtype
from services.engine.kv_pool import KVPool
from services.engine.model import LlamaModel
from services.engine.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)


def preset_fingerprint(cfg: NodeConfig, tokenizer_name: str) -> str:
    return model_fingerprint(PRESETS[cfg.model], preset_weights_digest(cfg.model, cfg.seed),
                             dtype_name(resolve_dtype(cfg.dtype)), tokenizer_name, cfg.block_size)


class ModelNode(Service):
    """Base of :class:`PrefillNode` and :class:`DecodeNode`."""

    def __init__(self, cfg: NodeConfig) -> None:
        super().__init__(cfg)
        self.cfg: NodeConfig = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.dtype = resolve_dtype(cfg.dtype)
        self.model_config = PRESETS[cfg.model]
        self.tokenizer = ByteTokenizer()
        self.fingerprint = preset_fingerprint(cfg, self.tokenizer.name)
        self.te = TransferEngine(cfg.secret.encode(), host=cfg.host, port=cfg.data_port)
        self.membership = Membership(self.etcd, nodes_prefix(cfg.cluster))
        self.model: LlamaModel | None = None
        self.pool: KVPool | None = None
        self.pool_region = -1
        self.segment: torch.Tensor | None = None
        self.segment_region = -1
        self.counters = {"computed": 0, "cached": 0, "fetched": 0, "generated": 0}
        self._store_channels: dict[str, grpc.aio.Channel] = {}

    async def setup(self) -> None:
        self.model = await asyncio.to_thread(LlamaModel.from_preset, self.cfg.model,
                                             self.cfg.seed, self.dtype)
        self.pool = KVPool.from_memory(self.model_config, parse_size(self.cfg.kv_memory),
                                       self.cfg.block_size, self.dtype)
        await self.te.start()
        self.pool_region = self.te.register(self.pool.kv)
        seg_bytes = parse_size(self.cfg.segment_memory)
        if seg_bytes:
            self.segment = torch.zeros(seg_bytes, dtype=torch.uint8)
            self.segment_region = self.te.register(self.segment)

    def node_info(self) -> dict[str, Any]:
        mc = self.model_config
        return {**super().node_info(), "data": self.te.address, "model": self.cfg.model,
                "fingerprint": self.fingerprint, "block_size": self.cfg.block_size,
                "max_context": mc.max_position_embeddings, "vocab_size": mc.vocab_size,
                "tokenizer": self.tokenizer.name, "kv_blocks": self.pool.num_blocks,
                "block_nbytes": self.pool.block_nbytes, "layer_nbytes": self.pool.layer_nbytes,
                "num_layers": mc.num_layers}

    async def after_start(self) -> None:
        self.membership.add_listener(self._on_member)
        await self.membership.start()
        for key, value in list(self.membership.nodes.items()):
            self._on_member("join", key, value)

    def _on_member(self, event: str, key: str, value: bytes | None) -> None:
        if event in ("join", "update") and "/store-master/" in key and self.segment is not None:
            asyncio.get_running_loop().create_task(self._mount(value))

    async def _mount(self, value: bytes | None) -> None:
        import json

        info = json.loads(value or b"{}")
        addr = info.get("grpc")
        if not addr:
            return
        req = pb.MountSegmentRequest(node_id=self.node_id, data_address=self.te.address,
                                     region_id=self.segment_region, size=self.segment.numel())
        for attempt in range(5):
            try:
                await self.store_stub(addr).MountSegment(req, timeout=5)
                log.info("lent %d bytes to store-master %s", self.segment.numel(), addr)
                return
            except grpc.aio.AioRpcError as e:
                log.warning("mounting segment on %s failed (%s); retrying", addr, e.code())
                await asyncio.sleep(0.5 * (attempt + 1))

    def store_stub(self, addr: str | None = None) -> pbg.StoreMasterStub | None:
        """A stub for ``addr`` or, by default, for any live store-master."""
        if addr is None:
            import json

            for key, value in self.membership.nodes.items():
                if "/store-master/" in key:
                    addr = json.loads(value).get("grpc")
                    break
            if addr is None:
                return None
        ch = self._store_channels.get(addr)
        if ch is None:
            ch = self._store_channels[addr] = grpc.aio.insecure_channel(addr)
        return pbg.StoreMasterStub(ch)

    def status(self, queue_depth: int = 0, running: int = 0) -> pb.NodeStatus:
        c = self.counters
        return pb.NodeStatus(
            node_id=self.node_id, role=self.role, grpc_address=self.grpc_address,
            data_address=self.te.address, model=self.cfg.model, fingerprint=self.fingerprint,
            kv_blocks_total=self.pool.num_blocks, kv_blocks_free=self.pool.num_free,
            queue_depth=queue_depth, running=running, computed_tokens_total=c["computed"],
            cached_tokens_total=c["cached"], fetched_tokens_total=c["fetched"],
            generated_tokens_total=c["generated"], reachable=True)

    async def teardown(self) -> None:
        await self.membership.stop()
        for ch in self._store_channels.values():
            await ch.close()
        await self.te.close()
        self.pool = None
        self.segment = None
