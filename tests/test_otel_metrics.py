"""The OpenTelemetry metrics path: the Prometheus registry bridged to OTel instruments."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import Counter

from kvmesh.services.common import metrics, otel_metrics
from kvmesh.services.common.otel_metrics import PrometheusBridge, metrics_data_to_dict


@pytest.fixture
def reader():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    bridge = PrometheusBridge(provider.get_meter("kvmesh-test"))
    yield reader, bridge
    provider.shutdown()


def _points(reader) -> dict[str, list[dict]]:
    return metrics_data_to_dict(reader.get_metrics_data())["metrics"]


def _value(points: dict, name: str, **attrs) -> float:
    found = [p["value"] for p in points.get(name, []) if p["attributes"] == attrs]
    assert len(found) == 1, (name, attrs, points.get(name))
    return found[0]


def _prom(name: str, **labels) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_counters_and_labels_match_prometheus(reader):
    reader, bridge = reader
    assert "kvmesh_requests_accepted_total" in bridge.instruments
    assert not any(n.endswith("_created") for n in bridge.instruments)
    metrics.REQUESTS_ACCEPTED.inc(3)
    metrics.REQUESTS_REJECTED.labels("ttft").inc()
    metrics.REQUESTS_REJECTED.labels("ttft").inc()
    p = _points(reader)
    assert _value(p, "kvmesh_requests_accepted_total") == _prom("kvmesh_requests_accepted_total")
    assert _value(p, "kvmesh_requests_accepted_total") >= 3
    assert (
        _value(p, "kvmesh_requests_rejected_total", reason="ttft")
        == _prom("kvmesh_requests_rejected_total", reason="ttft")
        >= 2
    )
    # Every reason Prometheus shows is there, none invented.
    prom_reasons = {
        s.labels["reason"]
        for f in metrics.REGISTRY.collect()
        if f.name == "kvmesh_requests_rejected"
        for s in f.samples
        if s.name.endswith("_total")
    }
    assert {q["attributes"]["reason"] for q in p["kvmesh_requests_rejected_total"]} == prom_reasons

    # The next collection reads the registry again (no stale snapshot).
    before = _value(p, "kvmesh_requests_accepted_total")
    metrics.REQUESTS_ACCEPTED.inc()
    p = _points(reader)
    assert _value(p, "kvmesh_requests_accepted_total") == before + 1


def test_histograms_export_prometheus_series(reader):
    reader, bridge = reader
    metrics.TTFT.observe(0.02)
    metrics.TTFT.observe(3.0)
    metrics.observe_transfer("handoff", 4096, 0.004)
    p = _points(reader)
    assert _value(p, "kvmesh_ttft_seconds_count") == _prom("kvmesh_ttft_seconds_count") >= 2
    assert _value(p, "kvmesh_ttft_seconds_sum") == pytest.approx(_prom("kvmesh_ttft_seconds_sum"))
    for le in ("0.025", "5.0", "+Inf"):
        assert _value(p, "kvmesh_ttft_seconds_bucket", le=le) == _prom(
            "kvmesh_ttft_seconds_bucket", le=le
        )
    assert _value(p, "kvmesh_ttft_seconds_bucket", le="+Inf") == _value(
        p, "kvmesh_ttft_seconds_count"
    )
    assert (
        _value(p, "kvmesh_transfer_seconds_count", path="handoff")
        == _prom("kvmesh_transfer_seconds_count", path="handoff")
        >= 1
    )
    assert _value(p, "kvmesh_transfer_bytes_total", path="handoff") >= 4096
    # OTel kinds and units: counters are monotonic cumulative sums.
    data = reader.get_metrics_data()
    kinds = {
        m.name: (type(m.data).__name__, m.unit, getattr(m.data, "is_monotonic", None))
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert kinds["kvmesh_ttft_seconds_bucket"][0] == "Sum"
    assert kinds["kvmesh_ttft_seconds_sum"][:2] == ("Sum", "s")
    assert kinds["kvmesh_requests_accepted_total"] == ("Sum", "", True)
    assert kinds["kvmesh_transfer_bytes_total"][1] == "By"


class _FakeStore:
    node_id, role = "store-x", "store-master"

    class meta:  # noqa: N801 - what _StateCollector reads
        used, capacity, blocks, segments, evictions = 1024, 4096, {1: 0, 2: 0}, {"s": 0}, 7


def test_gauges_from_live_state(reader):
    reader, bridge = reader
    svc = _FakeStore()
    metrics.track(svc)
    p = _points(reader)
    assert _value(p, "kvmesh_store_bytes", state="capacity") == 4096
    assert _value(p, "kvmesh_store_blocks") == 2
    assert _value(p, "kvmesh_store_evictions_total") == 7
    assert _value(p, "kvmesh_up", node="store-x", role="store-master") == 1
    data = reader.get_metrics_data()
    kinds = {
        m.name: type(m.data).__name__
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert kinds["kvmesh_store_bytes"] == "Gauge"
    metrics._STATE.services.discard(svc)


def test_families_registered_later_are_bridged(reader):
    reader, bridge = reader
    late = Counter(
        "kvmesh_test_late_total", "registered after the bridge", registry=metrics.REGISTRY
    )
    try:
        late.inc(5)
        reader.get_metrics_data()  # sees the new family; instruments come on a helper thread
        deadline = time.monotonic() + 5
        while "kvmesh_test_late_total" not in bridge.instruments and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _value(_points(reader), "kvmesh_test_late_total") == 5
    finally:
        metrics.REGISTRY.unregister(late)


def test_setup_metrics_file_and_reader(tmp_path, monkeypatch):
    """``setup_metrics`` (what every service runs via ``telemetry.setup_tracing``): readers
    passed in and the KVMESH_METRICS_FILE exporter get the bridged series, with the
    service's resource."""
    monkeypatch.setenv("KVMESH_METRICS_FILE", str(tmp_path) + "/")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    mem = InMemoryMetricReader()
    assert otel_metrics.setup_metrics("conductor", "c-1", readers=[mem], set_global=False)
    try:
        assert otel_metrics.setup_metrics("conductor", "c-1")  # idempotent
        metrics.REQUESTS_ACCEPTED.inc()
        want = _prom("kvmesh_requests_accepted_total")
        data = mem.get_metrics_data()
        assert (
            dict(data.resource_metrics[0].resource.attributes)["service.name"] == "kvmesh-conductor"
        )
        assert (
            _value(metrics_data_to_dict(data)["metrics"], "kvmesh_requests_accepted_total") == want
        )
    finally:
        otel_metrics.shutdown_metrics()  # final export to the file
    assert not otel_metrics.enabled()
    lines = otel_metrics.read_metrics(str(tmp_path))
    assert lines and lines[-1]["resource"]["service.instance.id"] == "c-1"
    assert _value(lines[-1]["metrics"], "kvmesh_requests_accepted_total") == want


def test_off_without_configuration(monkeypatch):
    for var in (
        "KVMESH_METRICS_FILE",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    ):
        monkeypatch.delenv(var, raising=False)
    assert not otel_metrics.setup_metrics("decode", "d-1", set_global=False)
    assert not otel_metrics.enabled()


def test_store_use_by_tier_is_exported():
    """The store-master's /metrics shows blocks and capacity per tier (DRAM, SSD)."""
    from prometheus_client import generate_latest

    from kvmesh.services.common.metrics import REGISTRY, track
    from kvmesh.services.store_master.metadata import StoreMetadata

    class Master:
        node_id, role = "store-tiers", "store-master"
        meta = StoreMetadata()

    master = Master()
    master.meta.mount("n1", "127.0.0.1:1", 1, 1 << 20, ssd_bytes=8 << 20)
    placed, _ = master.meta.put_start("n1", [b"k" * 16], 4096)
    master.meta.put_end([b"k" * 16])
    track(master)
    text = generate_latest(REGISTRY).decode()
    assert 'kvmesh_store_tier_blocks{tier="dram"} 1.0' in text
    assert 'kvmesh_store_tier_blocks{tier="ssd"} 0.0' in text
    assert 'kvmesh_store_tier_capacity_bytes{tier="ssd"} 8.388608e+06' in text
