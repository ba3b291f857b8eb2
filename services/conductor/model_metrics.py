"""Prometheus view of the conductor's time models: each node's prefill/decode model
prediction error (|predicted - observed| / observed, median and p90 over its recent
observations), each route's learned overhead and the slow tail of its TTFT estimate's
error, each prefill node's measured rate; and of its cache index: the blocks it knows
each node holds."""

from __future__ import annotations

import math

from prometheus_client.core import GaugeMetricFamily

from kvmesh.services.conductor.estimator import DecodeModel, PrefillModel
from kvmesh.services.conductor.policy import Scheduler


class ModelErrorCollector:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched

    def describe(self):
        return []

    def collect(self):
        err = GaugeMetricFamily(
            "kvmesh_model_prediction_error_ratio",
            "relative error of the conductor's time models over recent observations",
            labels=["node", "model", "quantile"],
        )
        obs = GaugeMetricFamily(
            "kvmesh_model_observations",
            "observations each time model was fitted on",
            labels=["node", "model"],
        )
        overhead = GaugeMetricFamily(
            "kvmesh_route_overhead_seconds", "learned TTFT overhead of each route", labels=["route"]
        )
        index = GaugeMetricFamily(
            "kvmesh_conductor_index_blocks",
            "KV blocks the conductor's cache index knows a node holds in its own pool",
            labels=["node"],
        )
        models: list[tuple[str, str, PrefillModel | DecodeModel]] = [
            (n, "prefill", p.model) for n, p in self.sched.prefill.items()
        ]
        for n, d in self.sched.decode.items():
            models += [(n, "decode_step", d.model), (n, "colocated_prefill", d.prefill_model)]
        for node, kind, m in models:
            for q, v in zip(("0.5", "0.9"), m.error_quantiles((0.5, 0.9))):
                if not math.isnan(v):
                    err.add_metric([node, kind, q], v)
            obs.add_metric([node, kind], m.observations)
        for route, ms in self.sched.overhead_ms.items():
            overhead.add_metric([route], ms / 1000)
        tail = GaugeMetricFamily(
            "kvmesh_conductor_ttft_error_tail_ratio",
            "slow tail of actual / estimated TTFT that admission scales estimates by "
            "(estimates: all; of 1/16 of the TTFT SLO or more; of 1/4 or more)",
            labels=["route", "estimates"],
        )
        for route, t in self.sched.error_tail.items():
            tail.add_metric([route, "all"], t.value)
            tail.add_metric([route, "mid"], t.mid_value)
            tail.add_metric([route, "near_slo"], t.near_value)
        speed = GaugeMetricFamily(
            "kvmesh_conductor_prefill_speed_ratio",
            "a prefill node's measured slot time per fitted-model ms",
            labels=["node"],
        )
        rate = GaugeMetricFamily(
            "kvmesh_conductor_prefill_tokens_per_second",
            "a prefill node's measured rate: prompt tokens per second of slot time",
            labels=["node"],
        )
        for node, p in self.sched.prefill.items():
            speed.add_metric([node], p.rate.factor(p.model))
            if not math.isnan(tps := p.rate.tokens_per_s):
                rate.add_metric([node], tps)
        for node in (*self.sched.prefill, *self.sched.decode):
            index.add_metric([node], self.sched.index.holds(node))
        return [err, obs, overhead, index, tail, speed, rate]
