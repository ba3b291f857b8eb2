"""What prefill and decode nodes share: a model replica, its KV pool registered with the
transfer engine, a DRAM segment lent to the store (mounted on every store-master that
joins), and counters reported by ``Status``."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

import grpc
import torch

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.rdma import TransferEngine
from kvmesh.services.common.channels import bind_error, check_port, make_channel
from kvmesh.services.common.config import parse_size
from kvmesh.services.common.cpu_budget import CpuBudget, threads_for
from kvmesh.services.common.node_events import EventHub
from kvmesh.services.common.registry import Membership, nodes_prefix
from kvmesh.services.common.service import Service
from kvmesh.services.common.settings import THREAD_SHARE_ENV
from kvmesh.services.common.tokenizer import ByteTokenizer, HFTokenizer
from kvmesh.services.engine.checkpoint import LoadedModel, load_model
from kvmesh.services.engine.config import ModelConfig, dtype_name, resolve_dtype
from kvmesh.services.engine.device import kv_memory_bytes, resolve_device
from kvmesh.services.engine.kv_pool import KVPool
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.engine.sampler_device import top_alternatives
from kvmesh.services.node_config import NodeConfig
from kvmesh.services.node_profile import profile
from kvmesh.services.store.client import StoreClient
from kvmesh.services.store.segment import SegmentHost

log = logging.getLogger(__name__)
T = TypeVar("T")

# A prefill node that gave up a request (failed, or cancelled by the conductor) tells the
# decode node, with an ordered notify ``drop:<prefill node id>\0<request id>`` sent once
# every write of its KV handoff has ended, that it will never write those blocks again: the
# decode node can then free a released reservation at once instead of fencing it.
DROP_PREFIX = b"drop:"


def drop_payload(node_id: str, request_id: str) -> bytes:
    return DROP_PREFIX + node_id.encode() + b"\0" + request_id.encode()


def parse_drop(payload: bytes) -> tuple[str, str] | None:
    """(prefill node id, request id) of a ``drop`` notify; None if it is not one."""
    if not payload.startswith(DROP_PREFIX) or b"\0" not in payload:
        return None
    node, _, rid = payload[len(DROP_PREFIX) :].partition(b"\0")
    return node.decode(errors="replace"), rid.decode(errors="replace")


async def to_the_end(aw: Awaitable[T]) -> T:
    """Awaits ``aw`` until it has really ended, even if this task is cancelled meanwhile,
    then re-raises the cancellation. For work that writes pool blocks behind the event
    loop's back (a forward on a worker thread, a transfer landing in or reading from the
    pool): cancelling the await would not stop it, and its blocks must not be freed, nor
    the compute slot passed on, before it stops."""
    fut = asyncio.ensure_future(aw)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(fut)
        except asyncio.CancelledError as e:
            if fut.done():  # the work itself was cancelled, not this wait
                raise
            cancelled = e
            continue
        if cancelled is not None:
            raise cancelled
        return result


def torch_threads(configured: int, env: Mapping[str, str] = os.environ) -> int:
    """The torch threads a node takes: its ``threads`` option where above 0 (a flag,
    ``KVMESH_THREADS``, a config file); else, unless ``OMP_NUM_THREADS`` says how many,
    its launcher's share of the machine's cores (``THREAD_SHARE_ENV``; a value that is not
    a positive number is ignored); else 0 (torch's default)."""
    if configured > 0:
        return configured
    if env.get("OMP_NUM_THREADS"):
        return 0
    share = env.get(THREAD_SHARE_ENV, "")
    return int(share) if share.isdigit() else 0


class ModelNode(Service):
    """Base of :class:`PrefillNode` and :class:`DecodeNode`."""

    def __init__(self, cfg: NodeConfig) -> None:
        super().__init__(cfg)
        self.cfg: NodeConfig = cfg
        # the CPU budget first: every thread started after (torch's, the transfer
        # engine's) is in the group too, and those before are moved with the process
        self.cpu_budget: CpuBudget | None = None
        if cfg.cpus > 0:
            self.cpu_budget = CpuBudget.create(f"{cfg.cluster}-{self.node_id}", cfg.cpus)
            self.cpu_budget.add()
            log.info(
                "CPU budget %.3g cores (cgroup v%d %s)",
                cfg.cpus,
                self.cpu_budget.version,
                self.cpu_budget.dirs[0],
            )
        threads = torch_threads(cfg.threads)
        if cfg.cpus > 0 and cfg.threads <= 0:
            threads = threads_for(cfg.cpus)
        if threads > 0:
            torch.set_num_threads(threads)
        # auto and float16 depend on where the model computes (float16: CUDA only)
        self.dtype = resolve_dtype(cfg.dtype, cuda=resolve_device(cfg.device).type == "cuda")
        # Set by setup() from load_model(cfg.model): a preset or a Hugging Face directory.
        self.loaded: LoadedModel | None = None
        self.model_config: ModelConfig | None = None
        self.tokenizer: ByteTokenizer | HFTokenizer | None = None
        self.fingerprint = ""
        self.te = TransferEngine(
            cfg.secret.encode(),
            host=cfg.host,
            port=cfg.data_port,
            checksum=cfg.checksum,
            poll_us=cfg.te_poll_us,
            max_conns=cfg.te_max_conns,
        )
        self.membership = Membership(self.etcd, nodes_prefix(cfg.cluster))
        self.model: LlamaModel | None = None
        self.pool: KVPool | None = None
        self.pool_region = -1
        # The store segment this node lends (DRAM + optional SSD tier, services.store).
        self.segment: SegmentHost | None = None
        self.segment_region = -1
        self.store: StoreClient | None = None  # the cluster KV store, set in after_start
        self.counters = {"computed": 0, "cached": 0, "fetched": 0, "generated": 0}
        self.profile: dict[str, list[list[float]]] = {}
        self.events: EventHub | None = None
        self._store_channels: dict[str, grpc.aio.Channel] = {}

    async def setup(self) -> None:
        data_addr = f"{self.cfg.host}:{self.cfg.data_port}"
        if self.cfg.data_port:  # before the model loads: a used port fails at once
            check_port(data_addr, "the KV data plane", "--data-port")
        self.loaded = await asyncio.to_thread(load_model, self.cfg.model, self.dtype, self.cfg.seed)
        self.model, self.model_config = self.loaded.model, self.loaded.config
        self.device = resolve_device(self.cfg.device)
        if self.device.type != "cpu":  # weights first: the pool's share is of what is left
            self.model.to(self.device)
        self.tokenizer = self.loaded.tokenizer
        self.fingerprint = self.loaded.fingerprint(dtype_name(self.dtype), self.cfg.block_size)
        self.pool = KVPool.from_memory(
            self.model_config,
            kv_memory_bytes(self.cfg.kv_memory, self.device),
            self.cfg.block_size,
            self.dtype,
            device=self.device,
        )
        self.profile = await asyncio.to_thread(
            profile,
            self.model,
            self.pool,
            self.cfg.block_size,
            self.model_config.max_position_embeddings,
        )
        self.events = EventHub(self.pool, self.load_info)
        try:
            await self.te.start()
        except OSError:  # taken since the check: PortInUse naming it, not a traceback
            raise bind_error(data_addr, "the KV data plane", "--data-port") from None
        # the pool itself on the CPU; its pinned host mirror on a GPU (engine/staging.py)
        self.pool_region = self.te.register(self.pool.transfer_kv)
        seg_bytes = parse_size(self.cfg.segment_memory)
        if seg_bytes:
            ssd = parse_size(self.cfg.ssd_bytes) if self.cfg.ssd_dir else 0
            self.segment = SegmentHost(self.te, self.node_id, seg_bytes, self.cfg.ssd_dir, ssd)
            self.segment.register()
            self.segment.add_to_server(self.server)
            self.segment_region = self.segment.region

    def node_info(self) -> dict[str, Any]:
        mc = self.model_config
        return {
            **super().node_info(),
            "data": self.cfg.advertise(self.te.address),
            "model": self.cfg.model,
            "model_path": self.loaded.path,
            "eos_ids": sorted(self.tokenizer.eos_ids),
            "fingerprint": self.fingerprint,
            "block_size": self.cfg.block_size,
            "max_context": mc.max_position_embeddings,
            "vocab_size": mc.vocab_size,
            "tokenizer": self.tokenizer.name,
            "kv_blocks": self.pool.num_blocks,
            "block_nbytes": self.pool.block_nbytes,
            "layer_nbytes": self.pool.layer_nbytes,
            "num_layers": mc.num_layers,
            "profile": self.profile,
            # writes only the blocks after a KVTarget's held_blocks (a decode node pins a
            # cached prefix for a disaggregated request only where every prefill node does)
            "kv_target_held_blocks": True,
            "cpus": self.cfg.cpus,  # its CPU budget in cores (0 = none)
        }

    async def after_start(self) -> None:
        if self.segment is not None:
            self.segment.grpc_address = self.grpc_address
        self.store = StoreClient(self.te, self.membership, self.node_id)
        self.membership.add_listener(self._on_member)
        await self.membership.start()  # existing members arrive as "join" events

    def _on_member(self, event: str, key: str, value: bytes | None) -> None:
        # Each store-master that joins (or restarts) gets the segment mounted and what it
        # holds re-reported; see services.store.segment.
        if self.segment is not None:
            self.segment.on_member(event, key, value)

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
            ch = self._store_channels[addr] = make_channel(addr)
        return pbg.StoreMasterStub(ch)

    def load_info(self) -> dict[str, Any]:
        """Load for the WatchEvents reports; subclasses add their queue and batch."""
        return {"bandwidth": dict(self.te.stats.get("bandwidth", {}))}

    async def watch_events(self, req: pb.WatchEventsRequest):
        interval = req.interval_ms / 1000 if req.interval_ms > 0 else 0.5
        async for event in self.events.stream(max(0.02, interval)):
            yield event

    def status(self, queue_depth: int = 0, running: int = 0) -> pb.NodeStatus:
        c = self.counters
        return pb.NodeStatus(
            node_id=self.node_id,
            role=self.role,
            grpc_address=self.grpc_address,
            data_address=self.te.address,
            model=self.cfg.model,
            fingerprint=self.fingerprint,
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_free=self.pool.num_free,
            queue_depth=queue_depth,
            running=running,
            computed_tokens_total=c["computed"],
            cached_tokens_total=c["cached"],
            fetched_tokens_total=c["fetched"],
            generated_tokens_total=c["generated"],
            reachable=True,
            cpu_budget_cores=self.cfg.cpus,
            cpu_seconds=self.cpu_seconds(),
        )

    def cpu_seconds(self) -> float:
        """CPU time this node has used: its budget cgroup's counter, else the process's."""
        used = self.cpu_budget.usage_seconds() if self.cpu_budget is not None else None
        if used is None:
            t = os.times()
            used = t.user + t.system
        return used

    async def teardown(self) -> None:
        await self.membership.stop()
        if self.store is not None:
            await self.store.close()
        if self.segment is not None:
            await self.segment.close()
        for ch in self._store_channels.values():
            await ch.close()
        if self.cpu_budget is not None:
            self.cpu_budget.close()
        await self.te.close()
        self.pool = None
        self.segment = None


def top_message(top: list[tuple[int, float]]) -> pb.TopLogprobs:
    """One token's alternatives ``[(id, logprob)]`` as the proto carries them."""
    return pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])


def first_alternatives(logits: torch.Tensor, sampling) -> pb.TopLogprobs | None:
    """The first token's top alternatives (a prompt's last logits), when the request's
    ``logprobs`` and ``top_logprobs`` ask for them; None otherwise."""
    if not (sampling.logprobs and sampling.top_logprobs):
        return None
    return top_message(top_alternatives(logits.reshape(1, -1), [sampling.top_logprobs])[0])
