"""TTFT estimate for a candidate prefill node (design §2.4):

    TTFT(p) = queue(p) + prefill(p, new, cached) + fetch(p) + handoff

prefill() is ``a + b·new + c·new·(new + cached)`` (attention's quadratic part), scaled by a
per-node correction learned online from observed prefills (EWMA of observed/predicted).
queue(p) is the summed prediction of what the conductor has in flight on p. fetch(p) is
the bytes of store blocks p must pull over the measured-or-configured bandwidth; handoff is
the last layer's transfer, the only part that cannot hide behind compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefillCost:
    """Plain coefficients of the prefill-time regression, in milliseconds."""

    base_ms: float = 5.0
    per_token_ms: float = 0.05
    per_token_pair_ms: float = 1e-6

    def predict(self, new: int, cached: int) -> float:
        return self.base_ms + self.per_token_ms * new + self.per_token_pair_ms * new * (new + cached)


@dataclass
class NodeEstimate:
    """The conductor's running view of one prefill node."""

    correction: float = 1.0
    inflight_ms: float = 0.0
    observations: int = 0
    cached_hashes: set[bytes] = field(default_factory=set)

    def observe(self, predicted_ms: float, actual_ms: float, alpha: float = 0.2) -> None:
        if predicted_ms > 0 and actual_ms > 0:
            ratio = min(max(actual_ms / predicted_ms, 0.05), 20.0)
            self.correction = (1 - alpha) * self.correction + alpha * ratio
            self.observations += 1

    def local_prefix(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cached_hashes:
                break
            n += 1
        return n


@dataclass
class Estimate:
    node_id: str
    ttft_ms: float
    queue_ms: float
    prefill_ms: float
    fetch_ms: float
    handoff_ms: float
    cached_blocks: int
    store_blocks: int


def estimate(node_id: str, view: NodeEstimate, cost: PrefillCost, n_tokens: int,
             block_size: int, hashes: list[bytes], store_prefix: int, block_nbytes: int,
             layer_nbytes: int, bandwidth_bytes_per_ms: float) -> Estimate:
    usable = min(len(hashes), (n_tokens - 1) // block_size)
    local = min(view.local_prefix(hashes), usable)
    store = max(0, min(store_prefix, usable) - local)
    fetch_ms = store * block_nbytes / bandwidth_bytes_per_ms
    recompute_ms = cost.predict(store * block_size, local * block_size) - cost.base_ms
    if fetch_ms >= recompute_ms:  # the bandwidth inequality: fetching must beat computing
        store, fetch_ms = 0, 0.0
    cached = (local + store) * block_size
    prefill_ms = view.correction * cost.predict(n_tokens - cached, cached)
    n_new_blocks = -(-n_tokens // block_size) - local - store
    handoff_ms = n_new_blocks * layer_nbytes / bandwidth_bytes_per_ms
    ttft = view.inflight_ms + prefill_ms + fetch_ms + handoff_ms
    return Estimate(node_id, ttft, view.inflight_ms, prefill_ms, fetch_ms, handoff_ms, local, store)
