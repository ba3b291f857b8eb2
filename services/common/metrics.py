"""Prometheus metrics of kvmesh (``/metrics`` on each service's metrics port).

Names follow the Prometheus conventions: ``kvmesh_`` prefix, base units in the name
(``_seconds``, ``_bytes``), ``_total`` on counters. Request-level metrics come from the
conductor (it sees every request from admission to the last token); node-level state
(queue depth, running batch, KV pool, prompt tokens computed/avoided, store use) is read
from the live services at scrape time by :class:`_StateCollector`, so the hot paths do
not pay for it. Data-plane metrics (bytes moved and transfer time by path, late hits)
are counted where the transfers happen (prefill node).

Every process has one registry, :data:`REGISTRY`; :func:`start_metrics_server` serves it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)

_LAT = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1,
    1.5,
    2.5,
    5,
    10,
    30,
    60,
)

# -- conductor: requests ----------------------------------------------------------------
REQUESTS_ACCEPTED = Counter(
    "kvmesh_requests_accepted_total", "requests admitted (prefill started)", registry=REGISTRY
)
REQUESTS_REJECTED = Counter(
    "kvmesh_requests_rejected_total",
    "requests refused before their first token, by reason",
    ["reason"],
    registry=REGISTRY,
)
REQUESTS_FINISHED = Counter(
    "kvmesh_requests_finished_total",
    "requests that ended, by finish reason (stop, length, error, cancelled)",
    ["finish_reason"],
    registry=REGISTRY,
)
TTFT = Histogram(
    "kvmesh_ttft_seconds",
    "time to first token, as the conductor sees it",
    buckets=_LAT,
    registry=REGISTRY,
)
TBT = Histogram(
    "kvmesh_tbt_seconds",
    "time between consecutive tokens of a request",
    buckets=_LAT,
    registry=REGISTRY,
)
SLO = Counter(
    "kvmesh_slo_requests_total",
    "finished requests by SLO (ttft, tbt) and whether it was attained",
    ["slo", "attained"],
    registry=REGISTRY,
)
ESTIMATE_ERROR = Histogram(
    "kvmesh_ttft_estimate_error_seconds",
    "|actual - estimated| TTFT of admitted requests",
    buckets=_LAT,
    registry=REGISTRY,
)
ESTIMATE_RATIO = Histogram(
    "kvmesh_ttft_estimate_ratio",
    "actual / estimated TTFT of admitted requests",
    buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2, 4, 10),
    registry=REGISTRY,
)
_SIGNED = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CONDUCTOR_ESTIMATE_ERROR = Histogram(
    "kvmesh_conductor_ttft_estimate_error_seconds",
    "actual - estimated TTFT of every accepted request, signed (> 0: the estimate was "
    "short), the conductor's admission estimate against the first token it relayed",
    buckets=(*(-x for x in reversed(_SIGNED)), 0.0, *_SIGNED),
    registry=REGISTRY,
)
ROUTES = Counter(
    "kvmesh_route_requests_total",
    "admitted requests by (prefill, decode) pair",
    ["prefill_node", "decode_node"],
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "kvmesh_request_prompt_tokens_total",
    "prompt tokens of finished requests, by how their KV was obtained "
    "(computed, cached = reused from a pool or the store)",
    ["kind"],
    registry=REGISTRY,
)
GENERATED = Counter(
    "kvmesh_request_completion_tokens_total",
    "completion tokens streamed to clients",
    registry=REGISTRY,
)

# -- prefill node: work and data plane -------------------------------------------------
PREFILL_SECONDS = Histogram(
    "kvmesh_prefill_seconds",
    "prefill compute + handoff time per request on a prefill node",
    buckets=_LAT,
    registry=REGISTRY,
)
PREFILL_QUEUE_SECONDS = Histogram(
    "kvmesh_prefill_queue_seconds",
    "time a prefill waited for the compute worker",
    buckets=_LAT,
    registry=REGISTRY,
)
PREFILL_REFUSED = Counter(
    "kvmesh_prefill_refused_total",
    "requests a prefill node refused before any work, by reason (deadline: it could no "
    "longer finish inside its TTFT SLO)",
    ["reason"],
    registry=REGISTRY,
)
PREFILL_WARMS = Counter(
    "kvmesh_prefill_warms_total",
    "warm-ups of a refused prompt's shared blocks a prefill node was asked for, by outcome "
    "(done; busy: the slot was taken; yielded: stopped for a request)",
    ["outcome"],
    registry=REGISTRY,
)
TRANSFER_BYTES = Counter(
    "kvmesh_transfer_bytes_total",
    "KV bytes moved by the transfer engine, by path "
    "(handoff = prefill->decode, store_get, store_put)",
    ["path"],
    registry=REGISTRY,
)
TRANSFER_SECONDS = Histogram(
    "kvmesh_transfer_seconds",
    "duration of one batched transfer, by path",
    ["path"],
    buckets=_LAT,
    registry=REGISTRY,
)
LATE_HITS = Counter(
    "kvmesh_late_hits_total",
    "store hits that did not help: the blocks were found but arrived too "
    "late (read lease expired) or failed to arrive, so they were recomputed",
    ["reason"],
    registry=REGISTRY,
)
# -- store-master: the raw-TCP control path ---------------------------------------------
STORE_FAST_CALLS = Counter(
    "kvmesh_store_fast_calls_total",
    "calls served on the store-master's raw-TCP control path, by whether it runs TLS",
    ["tls"],
    registry=REGISTRY,
)
STORE_FAST_REFUSED = Counter(
    "kvmesh_store_fast_refused_total",
    "connections to the store-master's raw-TCP control path refused in the TLS "
    "handshake (no or a wrong client certificate, plaintext, timeout)",
    registry=REGISTRY,
)
STORE_FAST_OVER_LIMIT = Counter(
    "kvmesh_store_fast_over_limit_total",
    "connections to the store-master's raw-TCP control path closed on accept because "
    "fast_max_conns connections or fast_max_handshakes pending TLS handshakes were open",
    ["limit"],
    registry=REGISTRY,
)
KV_WAITS = Counter(
    "kvmesh_kv_waits_total",
    "accepted requests that waited for KV room on their decode node, by cause (admission: "
    "admitted to wait for it; reserve_refused: the node refused a Reserve that the "
    "conductor's view had room for, and the TTFT SLO left time to wait)",
    ["cause"],
    registry=REGISTRY,
)
RESERVES_REFUSED = Counter(
    "kvmesh_reserves_refused_total",
    "Reserve calls a decode node refused for want of KV blocks although the conductor's "
    "view of its pool had room (the view was stale)",
    registry=REGISTRY,
)
for _cause in ("admission", "reserve_refused"):
    KV_WAITS.labels(_cause)
for _path in ("handoff", "store_get", "store_put"):
    TRANSFER_BYTES.labels(_path)
for _r in (
    "ttft",
    "tbt",
    "kv",
    "wait",
    "evicted",
    "deadline",
    "no_nodes",
    "infeasible",
    "invalid_argument",
    "unavailable",
):
    REQUESTS_REJECTED.labels(_r)


def observe_transfer(path: str, nbytes: int, seconds: float) -> None:
    TRANSFER_BYTES.labels(path).inc(nbytes)
    TRANSFER_SECONDS.labels(path).observe(seconds)


# -- node state read at scrape time ------------------------------------------------------
class _StateCollector:
    """Reads queue depth, running batch, KV pool, token counters and store use from the
    live services of this process (weakly held) when Prometheus scrapes."""

    def __init__(self) -> None:
        self.services: weakref.WeakSet[Any] = weakref.WeakSet()

    def describe(self):
        return []

    def collect(self):
        queue = GaugeMetricFamily(
            "kvmesh_queue_depth",
            "requests waiting (prefill: for the compute worker; decode: reserved, not yet running)",
            labels=["node", "role"],
        )
        running = GaugeMetricFamily(
            "kvmesh_running_requests", "requests in the running decode batch", labels=["node"]
        )
        kv = GaugeMetricFamily(
            "kvmesh_kv_blocks",
            "KV pool blocks by state (used, free)",
            labels=["node", "role", "state"],
        )
        kv_bytes = GaugeMetricFamily(
            "kvmesh_kv_pool_bytes", "KV pool bytes by state", labels=["node", "role", "state"]
        )
        tokens = CounterMetricFamily(
            "kvmesh_prefill_tokens",
            "prompt tokens handled by a prefill node, by kind "
            "(computed; cached = own pool; fetched = from the store)",
            labels=["node", "kind"],
        )
        avoided = CounterMetricFamily(
            "kvmesh_prefill_tokens_avoided",
            "prompt tokens whose KV was reused instead of computed",
            labels=["node"],
        )
        generated = CounterMetricFamily(
            "kvmesh_generated_tokens", "tokens decoded by a decode node", labels=["node"]
        )
        store = GaugeMetricFamily(
            "kvmesh_store_bytes", "cluster KV store bytes (used, capacity)", labels=["state"]
        )
        store_blocks = GaugeMetricFamily("kvmesh_store_blocks", "blocks in the cluster KV store")
        store_segments = GaugeMetricFamily("kvmesh_store_segments", "mounted store segments")
        evictions = CounterMetricFamily("kvmesh_store_evictions", "blocks evicted from the store")
        tier_blocks = GaugeMetricFamily(
            "kvmesh_store_tier_blocks", "blocks with a replica in each store tier", labels=["tier"]
        )
        tier_capacity = GaugeMetricFamily(
            "kvmesh_store_tier_capacity_bytes", "capacity of each store tier", labels=["tier"]
        )
        up = GaugeMetricFamily("kvmesh_up", "1 while the service serves", labels=["node", "role"])
        for s in list(self.services):
            try:
                self._one(
                    s,
                    queue,
                    running,
                    kv,
                    kv_bytes,
                    tokens,
                    avoided,
                    generated,
                    store,
                    store_blocks,
                    store_segments,
                    evictions,
                    up,
                    tier_blocks,
                    tier_capacity,
                )
            # AttributeError: a half-started service lacks some state yet; RuntimeError: a
            # dict the event loop resizes while this (scrape) thread iterates it
            except (AttributeError, RuntimeError) as e:
                log.debug("metrics of %s skipped: %s", getattr(s, "node_id", s), e)
        return [
            queue,
            running,
            kv,
            kv_bytes,
            tokens,
            avoided,
            generated,
            store,
            store_blocks,
            store_segments,
            evictions,
            up,
            tier_blocks,
            tier_capacity,
        ]

    @staticmethod
    def _one(
        s,
        queue,
        running,
        kv,
        kv_bytes,
        tokens,
        avoided,
        generated,
        store,
        store_blocks,
        store_segments,
        evictions,
        up,
        tier_blocks=None,
        tier_capacity=None,
    ) -> None:
        node, role = s.node_id, s.role
        up.add_metric([node, role], 0 if getattr(s, "_shutting_down", False) else 1)
        pool = getattr(s, "pool", None)
        if pool is not None:
            free = pool.num_free
            kv.add_metric([node, role, "free"], free)
            kv.add_metric([node, role, "used"], pool.num_blocks - free)
            kv_bytes.add_metric([node, role, "free"], free * pool.block_nbytes)
            kv_bytes.add_metric([node, role, "used"], (pool.num_blocks - free) * pool.block_nbytes)
        if role == "prefill":
            queue.add_metric([node, role], getattr(s, "queue_depth", 0))
            c = s.counters
            for kind in ("computed", "cached", "fetched"):
                tokens.add_metric([node, kind], c.get(kind, 0))
            avoided.add_metric([node], c.get("cached", 0) + c.get("fetched", 0))
        elif role == "decode":
            n_run = len(getattr(s, "running", ()))
            running.add_metric([node], n_run)
            queue.add_metric([node, role], max(0, len(getattr(s, "reservations", {})) - n_run))
            generated.add_metric([node], s.counters.get("generated", 0))
        meta = getattr(s, "meta", None)
        if role == "store-master" and meta is not None:
            store.add_metric(["used"], meta.used)
            store.add_metric(["capacity"], meta.capacity)
            store_blocks.add_metric([], len(meta.blocks))
            store_segments.add_metric([], len(meta.segments))
            evictions.add_metric([], meta.evictions)
            tiers = getattr(meta, "tier_counts", None)
            if callable(tiers):
                for tier, (blocks, capacity) in tiers().items():
                    tier_blocks.add_metric([tier], blocks)
                    tier_capacity.add_metric([tier], capacity)


class _CpuCollector:
    """Each model node's CPU budget and the CPU it used (its cgroup's counter)."""

    def describe(self):
        return []

    def collect(self):
        budget = GaugeMetricFamily(
            "kvmesh_cpu_budget_cores", "the node's CPU budget in cores (0 = none)", labels=["node"]
        )
        used = CounterMetricFamily(
            "kvmesh_cpu_seconds",
            "CPU time the node used (its budget cgroup's counter)",
            labels=["node"],
        )
        throttled = CounterMetricFamily(
            "kvmesh_cpu_throttled_seconds",
            "time the node's cgroup was held back by its CPU quota",
            labels=["node"],
        )
        for s in list(_STATE.services):
            seconds = getattr(s, "cpu_seconds", None)
            if not callable(seconds):
                continue
            b = getattr(s, "cpu_budget", None)
            budget.add_metric([s.node_id], b.cores if b is not None else 0.0)
            used.add_metric([s.node_id], seconds())
            if b is not None:
                throttled.add_metric([s.node_id], b.throttling()[2])
        return [budget, used, throttled]


class _DataPortCollector:
    """Connections each node's transfer-engine data port refused, by reason, read from
    its transport's counters (:mod:`kvmesh.rdma.tcp_accept`) at scrape time."""

    # reason label -> the transport's counter
    REASONS = {
        "limit": "conns_over_limit",
        "deadline": "handshake_timeouts",
        "auth": "auth_rejected",
        "error": "handshake_errors",
    }

    def describe(self):
        return []

    def collect(self):
        refused = CounterMetricFamily(
            "kvmesh_data_port_refused_total",
            "connections the transfer engine's data port closed before serving them, by "
            "reason: limit (te_max_conns connections were open), deadline (handshake not "
            "finished in time), auth (wrong cluster secret), error (closed mid-handshake)",
            labels=["node", "reason"],
        )
        for s in list(_STATE.services):
            te = getattr(s, "te", None)
            stats = getattr(te, "stats", None)
            if not isinstance(stats, dict):
                continue
            for reason, key in self.REASONS.items():
                refused.add_metric([s.node_id, reason], stats.get(key, 0))
        return [refused]


_STATE = _StateCollector()
REGISTRY.register(_STATE)
REGISTRY.register(_CpuCollector())
REGISTRY.register(_DataPortCollector())


def track(service: Any) -> None:
    """Reports ``service``'s live state on this process's /metrics."""
    _STATE.services.add(service)


def start_metrics_server(host: str, port: int):
    """Serves /metrics on ``host:port`` (0 = any free port) in a daemon thread; returns
    (server, bound port)."""
    server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    return server, server.server_port


# -- rolling view for `kvmesh status` ------------------------------------------------------
class RequestStats:
    """What the conductor remembers for ``ClusterStatus``: recent TTFT/TBT samples (last
    ``window_s`` seconds, at most ``max_samples``), acceptance counts and routes."""

    def __init__(self, window_s: float = 300.0, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self.ttft: collections.deque = collections.deque(maxlen=max_samples)
        self.tbt: collections.deque = collections.deque(maxlen=max_samples)
        self.accepted = 0
        self.rejected: collections.Counter = collections.Counter()
        self.routes: collections.Counter = collections.Counter()
        self.slo_met = 0
        self.slo_total = 0
        self._lock = threading.Lock()

    def add_ttft(self, seconds: float) -> None:
        self.ttft.append((time.monotonic(), seconds))

    def add_tbt(self, seconds: float) -> None:
        self.tbt.append((time.monotonic(), seconds))

    def _recent(self, dq) -> list[float]:
        cut = time.monotonic() - self.window_s
        return sorted(v for t, v in list(dq) if t >= cut)

    @staticmethod
    def percentile(sorted_values: list[float], q: float) -> float:
        if not sorted_values:
            return 0.0
        i = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
        return sorted_values[i]

    def summary(self) -> dict[str, Any]:
        ttft, tbt = self._recent(self.ttft), self._recent(self.tbt)
        out = {
            "window_s": self.window_s,
            "requests_accepted": self.accepted,
            "requests_rejected": sum(self.rejected.values()),
            "rejected_by_reason": dict(self.rejected),
            "slo_attainment": (self.slo_met / self.slo_total) if self.slo_total else 0.0,
            "top_routes": self.routes.most_common(5),
        }
        for name, vals in (("ttft", ttft), ("tbt", tbt)):
            for q in (50, 90, 99):
                out[f"{name}_p{q}_ms"] = self.percentile(vals, q / 100) * 1000
        return out


__all__ = ["REGISTRY", "track", "start_metrics_server", "observe_transfer", "RequestStats"]
