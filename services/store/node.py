"""store-node: a process that only lends DRAM (and optionally an SSD directory) to the
cluster KV store - no model. Used by benchmarks and tests, and by operators who want
store capacity on machines without accelerators.

    python -m kvmesh.services.store.node --etcd 127.0.0.1:2379 --segment-memory 2GiB
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Gauge

from kvmesh.rdma import TransferEngine
from kvmesh.rdma.tcp import MAX_CONNS
from kvmesh.services.common import metrics
from kvmesh.services.common.config import ConfigError, load, option, parse_size
from kvmesh.services.common.registry import Membership, nodes_prefix
from kvmesh.services.common.service import Service, run, setup_logging
from kvmesh.services.common.settings import (
    DEV_SECRET,
    TE_MAX_CONNS_HELP,
    ServiceConfig,
    check_data_plane_secret,
)
from kvmesh.services.store.segment import SegmentHost

# read at scrape time, like the other node-level state (see kvmesh.services.common.metrics)
INDEXED_BLOCKS = Gauge(
    "kvmesh_store_node_indexed_blocks",
    "DRAM blocks in a store-node's index: what it re-reports when a store-master (re)starts",
    ["node"],
    registry=metrics.REGISTRY,
)


@dataclass
class StoreNodeConfig(ServiceConfig):
    """store-node: lends memory (and disk) to the cluster KV store."""

    segment_memory: str = option("1GiB", "DRAM this node lends to the cluster KV store")
    ssd_dir: str = option("", "directory of the SSD tier (empty = no SSD tier)")
    ssd_bytes: str = option("0", "most bytes of block data the SSD tier keeps")
    data_port: int = option(0, "transfer-engine (data plane) port (0 = any free port)")
    secret: str = option(DEV_SECRET, "cluster secret; data-plane peers must share it")
    te_poll_us: int = option(
        200, "transfer engine busy-poll window in microseconds (CPU for latency; 0 = never spin)"
    )
    te_max_conns: int = option(
        MAX_CONNS,
        TE_MAX_CONNS_HELP,
    )

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.te_poll_us <= 5000:
            raise ConfigError(f"te_poll_us: {self.te_poll_us} must be between 0 and 5000")
        if not 1 <= self.te_max_conns <= 1 << 20:
            raise ConfigError(f"te_max_conns: {self.te_max_conns} must be between 1 and {1 << 20}")
        if parse_size(self.segment_memory) <= 0:
            raise ConfigError("segment_memory: must be > 0")
        if self.ssd_dir and parse_size(self.ssd_bytes) <= 0:
            raise ConfigError("ssd_bytes: must be > 0 when ssd_dir is set")
        if not self.secret:
            raise ConfigError("secret: the cluster secret must not be empty")
        check_data_plane_secret(self.secret, self.host)


class StoreNode(Service):
    role = "store-node"

    def __init__(self, cfg: StoreNodeConfig) -> None:
        super().__init__(cfg)
        self.te = TransferEngine(
            cfg.secret.encode(),
            host=cfg.host,
            port=cfg.data_port,
            poll_us=cfg.te_poll_us,
            max_conns=cfg.te_max_conns,
        )
        self.host = SegmentHost(
            self.te,
            self.node_id,
            parse_size(cfg.segment_memory),
            cfg.ssd_dir,
            parse_size(cfg.ssd_bytes) if cfg.ssd_dir else 0,
        )
        self.membership = Membership(self.etcd, nodes_prefix(cfg.cluster))
        INDEXED_BLOCKS.labels(self.node_id).set_function(lambda: len(self.host.index))

    async def setup(self) -> None:
        await self.te.start()
        self.host.register()
        self.host.add_to_server(self.server)

    def node_info(self) -> dict:
        return {
            **super().node_info(),
            "data": self.cfg.advertise(self.te.address),
            "segment": self.host.size,
        }

    async def after_start(self) -> None:
        self.host.grpc_address = self.grpc_address
        self.membership.add_listener(self.host.on_member)
        await self.membership.start()
        for key, value in list(self.membership.nodes.items()):
            self.host.on_member("join", key, value)

    async def teardown(self) -> None:
        await self.membership.stop()
        await self.host.close()
        await self.te.close()
        INDEXED_BLOCKS.remove(self.node_id)


def main(argv: list[str] | None = None) -> None:
    cfg = load(StoreNodeConfig, argv, prog="kvmesh store-node", section="store-node")
    setup_logging(cfg.log_level, "store-node")
    run(lambda: StoreNode(cfg))


if __name__ == "__main__":
    main()
