"""vLLM's Prometheus series, beside kvmesh's own, so that a dashboard or a benchmark's
scraper built for ``vllm serve`` reads a kvmesh conductor unchanged (``/metrics`` on the
API port and on the metrics port; documented in docs/operations.md).

Each carries vLLM's ``model_name`` label: the first ``--served-model-name``, else the
model's own name. Names and units are vLLM's; a counter's samples get prometheus_client's
``_total`` suffix, as vLLM's do (``vllm:prompt_tokens_total``). What each means here:

* ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` (each gap
  between tokens, one sample per token), ``vllm:e2e_request_latency_seconds`` (arrival to
  the last token): histograms with vLLM's buckets, of every request that got a token;
* ``vllm:num_requests_running`` (past their first token, decoding) and
  ``vllm:num_requests_waiting`` (admitted by this conductor, first token not yet out:
  queued or in prefill): this conductor's requests;
* ``vllm:kv_cache_usage_perc``: the share (0-1, as vLLM's) of the model's decode nodes'
  KV blocks in use, from their last load reports;
* ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``: prompt tokens of finished
  requests / those of them whose KV was reused (a node's pool or the store);
* ``vllm:prompt_tokens`` / ``vllm:generation_tokens``: prompt and generated tokens of
  finished requests.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from kvmesh.services.common.metrics import REGISTRY

LABEL = ["model_name"]

TTFT = Histogram(
    "vllm:time_to_first_token_seconds",
    "Histogram of time to first token in seconds.",
    LABEL,
    # fmt: off
    buckets=(
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
        160.0,
        640.0,
        2560.0,
    ),
    # fmt: on
    registry=REGISTRY,
)
ITL = Histogram(
    "vllm:inter_token_latency_seconds",
    "Histogram of inter-token latency in seconds.",
    LABEL,
    # fmt: off
    buckets=(
        0.01,
        0.025,
        0.05,
        0.075,
        0.1,
        0.15,
        0.2,
        0.3,
        0.4,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
    ),
    # fmt: on
    registry=REGISTRY,
)
E2E = Histogram(
    "vllm:e2e_request_latency_seconds",
    "Histogram of e2e request latency in seconds.",
    LABEL,
    # fmt: off
    buckets=(
        0.3,
        0.5,
        0.8,
        1.0,
        1.5,
        2.0,
        2.5,
        5.0,
        10.0,
        15.0,
        20.0,
        30.0,
        40.0,
        50.0,
        60.0,
        120.0,
        240.0,
        480.0,
        960.0,
        1920.0,
        7680.0,
    ),
    # fmt: on
    registry=REGISTRY,
)
RUNNING = Gauge(
    "vllm:num_requests_running",
    "Number of requests in model execution batches (here: past their first token).",
    LABEL,
    registry=REGISTRY,
)
WAITING = Gauge(
    "vllm:num_requests_waiting",
    "Number of requests waiting to be processed (here: before their first token).",
    LABEL,
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "vllm:prompt_tokens", "Number of prefill tokens processed.", LABEL, registry=REGISTRY
)
GENERATION_TOKENS = Counter(
    "vllm:generation_tokens", "Number of generation tokens processed.", LABEL, registry=REGISTRY
)
PREFIX_CACHE_QUERIES = Counter(
    "vllm:prefix_cache_queries",
    "Prefix cache queries, in terms of number of queried tokens.",
    LABEL,
    registry=REGISTRY,
)
PREFIX_CACHE_HITS = Counter(
    "vllm:prefix_cache_hits",
    "Prefix cache hits, in terms of number of cached tokens.",
    LABEL,
    registry=REGISTRY,
)


class KvUsageCollector:
    """``vllm:kv_cache_usage_perc`` per model, read at scrape time from the scheduler's
    decode nodes (their last load reports) and the cluster view (which node serves which
    model); ``name(model)`` gives the label."""

    def __init__(self, sched: Any, view: Any, name: Any) -> None:
        self.sched, self.view, self.name = sched, view, name

    def describe(self):
        return []

    def collect(self):
        g = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labels=LABEL,
        )
        model_of = {n.node_id: n.model for n in self.view.nodes("decode")}
        used: dict[str, list[int]] = {}
        for node_id, d in list(self.sched.decode.items()):
            model = model_of.get(node_id)
            if model is None or d.kv_blocks_total <= 0:
                continue
            u = used.setdefault(model, [0, 0])
            u[0] += d.kv_blocks_total - d.kv_blocks_free
            u[1] += d.kv_blocks_total
        for model, (busy, total) in sorted(used.items()):
            g.add_metric([self.name(model)], max(0.0, min(1.0, busy / total)))
        return [g]


class RequestSeries:
    """One request's part in the vllm: series: waiting from its start, running from its
    first token; :meth:`finish` at its end (any end)."""

    def __init__(self, model_name: str, t0: float) -> None:
        self.label = model_name
        self.t0 = t0
        self.running = False
        WAITING.labels(model_name).inc()

    def first_token(self, ttft: float) -> None:
        TTFT.labels(self.label).observe(ttft)
        WAITING.labels(self.label).dec()
        RUNNING.labels(self.label).inc()
        self.running = True

    def gaps(self, gap: float, n: int) -> None:
        h = ITL.labels(self.label)
        for _ in range(n):
            h.observe(gap)

    def usage(self, prompt: int, cached: int, completion: int) -> None:
        PROMPT_TOKENS.labels(self.label).inc(prompt)
        GENERATION_TOKENS.labels(self.label).inc(completion)
        PREFIX_CACHE_QUERIES.labels(self.label).inc(prompt)
        PREFIX_CACHE_HITS.labels(self.label).inc(cached)

    def finish(self, now: float) -> None:
        if self.running:
            RUNNING.labels(self.label).dec()
            E2E.labels(self.label).observe(now - self.t0)
        else:
            WAITING.labels(self.label).dec()
