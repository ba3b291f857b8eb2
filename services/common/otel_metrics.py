"""OpenTelemetry export of kvmesh's metrics: the Prometheus registry, bridged.

Every kvmesh metric lives in one place, the Prometheus :data:`kvmesh.services.common.metrics.REGISTRY`
(served on ``/metrics``). This module exports *the same* ``kvmesh_*`` series through
OpenTelemetry too, without a second set of instruments on the hot paths:
:class:`PrometheusBridge` registers one OTel *observable* instrument per Prometheus sample
name, and on each OTel collection reads the registry (``REGISTRY.collect()``, i.e. exactly
what a scrape of ``/metrics`` would see, the node state of ``_StateCollector`` included)
and reports its samples, labels becoming attributes:

  Prometheus                         OpenTelemetry
  counter ``x`` (sample ``x_total``)   ObservableCounter ``x_total`` (cumulative, monotonic)
  gauge ``x``                          ObservableGauge ``x``
  histogram ``x``                      ObservableCounter ``x_bucket`` (attribute ``le``, the
                                       cumulative bucket counts, as in Prometheus),
                                       ObservableCounter ``x_sum`` and ``x_count``
  summary ``x``                        ObservableCounter ``x_sum``/``x_count``, gauge ``x``
  info / stateset / unknown            ObservableGauge

Histograms: OTel has no observable histogram, so the choice was between feeding a second,
synchronous OTel Histogram from every ``observe()`` (a hook on each hot path and a second
bucket layout to keep in step) and exporting the Prometheus histogram's series as they are.
We export them as they are: ``x_bucket{le}``/``x_sum``/``x_count`` cumulative counters are
the exact series Prometheus stores, so ``histogram_quantile(.., rate(x_bucket[5m]))`` and
the Grafana dashboard in ``deploy/`` work unchanged on a backend fed through OTLP; the cost
is that an OTel-native backend sees three counters rather than one Histogram point.
``_created`` samples are not exported (OTel carries start times itself).

Turned on by :func:`setup_metrics` (called from ``telemetry.setup_tracing`` so every service
gets it) when one of these is set:

  OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_METRICS_ENDPOINT)
      OTLP export (gRPC or http/protobuf exporter, chosen by OTEL_EXPORTER_OTLP_PROTOCOL /
      OTEL_EXPORTER_OTLP_METRICS_PROTOCOL, see ``otlp.otlp_exporter``) every
      OTEL_METRIC_EXPORT_INTERVAL ms (default 60000); OTEL_METRICS_EXPORTER=none turns
      just the metrics off;
  KVMESH_METRICS_FILE=/path
      test/debug mode: each export is appended as one JSON line (a directory, or a path
      ending in "/", gets ``<role>-<pid>.jsonl``); :func:`read_metrics` reads them back.

Tests may pass their own readers (e.g. ``InMemoryMetricReader``) to :func:`setup_metrics`,
or build a ``MeterProvider`` and a :class:`PrometheusBridge` on it directly.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)

from kvmesh.services.common.otlp import otlp_exporter, read_jsonl

log = logging.getLogger(__name__)

METER_NAME = "kvmesh"

_provider = None
_bridge: PrometheusBridge | None = None
_setup_lock = threading.Lock()

# (sample-name suffix, OTel kind) of each Prometheus metric type; "" = the family name.
_SERIES: dict[str, list[tuple[str, str]]] = {
    "counter": [("_total", "counter")],
    "gauge": [("", "gauge")],
    "histogram": [("_bucket", "counter"), ("_sum", "counter"), ("_count", "counter")],
    "gaugehistogram": [("_bucket", "gauge"), ("_gsum", "gauge"), ("_gcount", "gauge")],
    "summary": [("_sum", "counter"), ("_count", "counter"), ("", "gauge")],
    "info": [("_info", "gauge")],
    "stateset": [("", "gauge")],
    "unknown": [("", "gauge")],
}


def _unit(family: str, suffix: str) -> str:
    if suffix in ("_bucket", "_count", "_gcount"):
        return "1"
    if family.endswith("_seconds"):
        return "s"
    if family.endswith("_bytes"):
        return "By"
    return ""


class PrometheusBridge:
    """Reports the samples of a Prometheus registry through OTel observable instruments
    created on ``meter`` (see the module doc for the mapping).

    One registry read serves a whole OTel collection: the snapshot is refreshed when an
    instrument is called that was already served from the current snapshot (i.e. the next
    collection has begun) or when it is older than ``max_age_s``. Families that appear in
    the registry later get instruments too, from the collection after they are first seen
    (instruments cannot be created while the SDK collects, so that happens on a helper
    thread; :meth:`sync` does it at once)."""

    def __init__(
        self, meter: Meter, registry: Any = None, prefix: str = "kvmesh_", max_age_s: float = 1.0
    ) -> None:
        if registry is None:
            from kvmesh.services.common.metrics import REGISTRY

            registry = REGISTRY
        self.meter = meter
        self.registry = registry
        self.prefix = prefix
        self.max_age_s = max_age_s
        self.instruments: dict[str, Any] = {}  # sample name -> OTel instrument
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._snapshot: dict[str, list[tuple[dict[str, str], float]]] | None = None
        self._snapshot_at = 0.0
        self._served: set[str] = set()
        self._unbridged: dict[str, tuple[str, str, str]] = {}
        self._sync_thread: threading.Thread | None = None
        self.sync()

    # -- registry ------------------------------------------------------------------------
    def _read_registry(self):
        """(samples by name, {sample name: (kind, unit, help)}) of the registry now."""
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        series: dict[str, tuple[str, str, str]] = {}
        for fam in self.registry.collect():
            if not fam.name.startswith(self.prefix):
                continue
            wanted = {}
            for suffix, kind in _SERIES.get(fam.type, _SERIES["unknown"]):
                name = fam.name + suffix
                wanted[name] = (kind, _unit(fam.name, suffix), fam.documentation or "")
            series.update(wanted)
            for s in fam.samples:
                if s.name in wanted:  # skips _created (and anything unexpected)
                    samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
        return samples, series

    def sync(self) -> int:
        """Creates instruments for the registry's series that have none yet; returns how
        many it created. Must not run inside an OTel collection (the SDK holds a lock)."""
        with self._sync_lock:
            if self._unbridged:
                series, self._unbridged = self._unbridged, {}
            else:
                _, series = self._read_registry()
            created = 0
            for name, (kind, unit, doc) in sorted(series.items()):
                if name in self.instruments:
                    continue
                create = (
                    self.meter.create_observable_counter
                    if kind == "counter"
                    else self.meter.create_observable_gauge
                )
                self.instruments[name] = create(
                    name, callbacks=[self._callback(name)], unit=unit, description=doc
                )
                created += 1
            return created

    # -- collection ----------------------------------------------------------------------
    def _callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(value, labels) for labels, value in self._read(name)]

        return observe

    def _read(self, name: str) -> list[tuple[dict[str, str], float]]:
        with self._lock:
            now = time.monotonic()
            if (
                self._snapshot is None
                or name in self._served
                or now - self._snapshot_at > self.max_age_s
            ):
                try:
                    self._snapshot, series = self._read_registry()
                # broad on purpose: a registered collector may raise anything, and one
                # broken collector must not break the export of every other series
                except Exception:
                    log.exception("reading the metrics registry failed")
                    self._snapshot, series = {}, {}
                self._snapshot_at = now
                self._served = set()
                new = {k: v for k, v in series.items() if k not in self.instruments}
                if new:
                    self._unbridged.update(new)
                    self._sync_later()
            self._served.add(name)
            return self._snapshot.get(name, [])

    def _sync_later(self) -> None:
        if self._sync_thread is not None and self._sync_thread.is_alive():
            return
        self._sync_thread = threading.Thread(
            target=self._safe_sync, name="otel-metrics-sync", daemon=True
        )
        self._sync_thread.start()

    def _safe_sync(self) -> None:
        try:
            self.sync()
        except Exception:  # broad on purpose: the end of a helper thread, nothing above it
            log.exception("bridging new metric families failed")


# ------------------------------------------------------------------ file exporter


def metrics_data_to_dict(data: Any) -> dict[str, Any]:
    """A flat, JSON-friendly view of an OTel ``MetricsData``: resource attributes and
    ``{metric name: [{"attributes", "value"} | histogram fields]}``."""
    out: dict[str, Any] = {"ts_ns": time.time_ns(), "resource": {}, "metrics": {}}
    for rm in data.resource_metrics:
        out["resource"].update(dict(rm.resource.attributes))
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                points = out["metrics"].setdefault(m.name, [])
                for p in m.data.data_points:
                    point: dict[str, Any] = {"attributes": dict(p.attributes or {})}
                    if hasattr(p, "value"):
                        point["value"] = p.value
                    else:  # an OTel-native histogram (not produced by the bridge)
                        point.update(count=getattr(p, "count", None), sum=getattr(p, "sum", None))
                    points.append(point)
    return out


class JsonLinesMetricExporter(MetricExporter):
    """Appends each export as one JSON line (see :func:`metrics_data_to_dict`)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        line = json.dumps(metrics_data_to_dict(metrics_data), default=str) + "\n"
        with self._lock:
            if self._fd >= 0:
                os.write(self._fd, line.encode())
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Every export written by :class:`JsonLinesMetricExporter` under ``path`` (a file or a
    directory of ``*.jsonl``), oldest first within each file."""
    return read_jsonl(path)


# ------------------------------------------------------------------ setup


def _otlp_metric_exporter():
    return otlp_exporter("metrics")


def setup_metrics(
    role: str, node_id: str, *, readers: Sequence[Any] = (), set_global: bool = True
) -> bool:
    """Starts a ``MeterProvider`` whose readers export the bridged registry, if an exporter
    is configured (module doc) or ``readers`` are given; returns whether it runs.
    Idempotent (the first successful call wins until :func:`shutdown_metrics`)."""
    global _provider, _bridge
    with _setup_lock:
        if _provider is not None:
            return True
        all_readers = list(readers)
        path = os.environ.get("KVMESH_METRICS_FILE", "")
        if path:
            if path.endswith("/") or os.path.isdir(path):
                path = os.path.join(path, f"{role}-{os.getpid()}.jsonl")
            all_readers.append(PeriodicExportingMetricReader(JsonLinesMetricExporter(path)))
        otlp = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
        )
        if otlp and os.environ.get("OTEL_METRICS_EXPORTER", "").strip().lower() != "none":
            exporter = _otlp_metric_exporter()
            if exporter is not None:
                all_readers.append(PeriodicExportingMetricReader(exporter))
        if not all_readers:
            return False
        from opentelemetry import metrics as otel_metrics_api
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import Resource

        provider = MeterProvider(
            metric_readers=all_readers,
            resource=Resource.create(
                {"service.name": f"kvmesh-{role}", "service.instance.id": node_id}
            ),
        )
        _bridge = PrometheusBridge(provider.get_meter(METER_NAME))
        _provider = provider
        if set_global:
            otel_metrics_api.set_meter_provider(provider)
        log.info(
            "OpenTelemetry metrics on (%d series bridged from the Prometheus registry)",
            len(_bridge.instruments),
        )
        return True


def enabled() -> bool:
    return _provider is not None


def bridge() -> PrometheusBridge | None:
    return _bridge


def shutdown_metrics(timeout_millis: float = 5_000) -> None:
    """Exports once more and stops the readers (an unreachable collector is only logged)."""
    global _provider, _bridge
    with _setup_lock:
        provider, _provider, _bridge = _provider, None, None
    if provider is not None:
        try:
            provider.shutdown(timeout_millis=timeout_millis)
        # broad on purpose: MeterProvider.shutdown raises a bare Exception for any reader
        # that failed (an unreachable collector), and shutting down must go on
        except Exception:
            log.exception("flushing metrics failed")


__all__ = [
    "PrometheusBridge",
    "setup_metrics",
    "shutdown_metrics",
    "read_metrics",
    "JsonLinesMetricExporter",
    "metrics_data_to_dict",
    "enabled",
    "bridge",
]
