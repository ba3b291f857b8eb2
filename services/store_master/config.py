"""The store-master's configuration (``kvmesh store-master --help``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.services.common.config import ConfigError, option
from kvmesh.services.common.settings import ServiceConfig


@dataclass
class StoreMasterConfig(ServiceConfig):
    """store-master: metadata of the cluster KV block store."""

    lease_ms: int = option(10000, "read lease granted with replica locations, in ms")
    put_timeout_s: float = option(30.0, "a put not ended within this is reclaimed")
    high_watermark: float = option(0.9, "eviction starts above this fraction of capacity")
    low_watermark: float = option(0.8, "eviction frees down to this fraction of capacity")
    hot_reads: float = option(
        8.0, "a block read this often within hot_window_s gets another replica"
    )
    hot_window_s: float = option(2.0, "time constant of the decayed read count of a block")
    max_replicas: int = option(3, "most DRAM replicas a hot block gets (1 = no replication)")
    fast_path: bool = option(
        True,
        "also serve the hot calls on a raw-TCP control path "
        "(advertised in StoreHello; under TLS it speaks TLS with the gRPC certificate and CA)",
    )
    fast_port: int = option(0, "port of the raw-TCP control path (0 = any free port)")
    fast_poll_us: int = option(
        200,
        "busy-poll window of the raw-TCP control path in "
        "microseconds: after answering, the event loop polls "
        "for the next call this long before sleeping (CPU for "
        "latency; 0 = never spin)",
    )
    fast_max_conns: int = option(
        1024,
        "most connections the raw-TCP control path holds at once (served or in their "
        "TLS handshake); one more is closed on accept and its client uses gRPC",
    )
    fast_max_handshakes: int = option(
        64,
        "most TLS handshakes the raw-TCP control path has pending at once (each may "
        "take 10 s); one more is closed on accept",
    )

    def validate(self) -> None:
        super().validate()
        if self.lease_ms <= 0:
            raise ConfigError("lease_ms: must be > 0")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ConfigError("watermarks: need 0 < low_watermark < high_watermark <= 1")
        if self.max_replicas < 1:
            raise ConfigError("max_replicas: must be >= 1")
        if self.hot_reads <= 0 or self.hot_window_s <= 0:
            raise ConfigError("hot_reads and hot_window_s: must be > 0")
        if not 0 <= self.fast_port < 65536:
            raise ConfigError(f"fast_port: {self.fast_port} is not a TCP port (0-65535)")
        if not 0 <= self.fast_poll_us <= 5000:
            raise ConfigError(
                f"fast_poll_us: {self.fast_poll_us} must be between 0 and 5000 "
                f"(the event loop spins that long at most)"
            )
        if self.fast_max_conns < 1 or self.fast_max_handshakes < 1:
            raise ConfigError(
                f"fast_max_conns ({self.fast_max_conns}) and fast_max_handshakes "
                f"({self.fast_max_handshakes}): must be >= 1"
            )
