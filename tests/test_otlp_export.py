"""OTLP export end to end: a real cluster exports its spans and kvmesh_* metrics over
OTLP/HTTP (protobuf) to a tiny collector on loopback, which decodes what it receives."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (  # noqa: E402
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from kvmesh.services.launcher import LocalCluster  # noqa: E402
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, generate  # noqa: E402

pytestmark = pytest.mark.timeout(180)

PROMPT = "The quick brown fox jumps over the lazy dog; " * 2


class Collector:
    """Accepts POST /v1/traces and /v1/metrics (OTLP/HTTP, protobuf) and keeps the decoded
    requests."""

    def __init__(self) -> None:
        self.traces: list[ExportTraceServiceRequest] = []
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                enc = (self.headers.get("Content-Encoding") or "").lower()
                if enc == "gzip":
                    body = gzip.decompress(body)
                elif enc == "deflate":
                    body = zlib.decompress(body)
                kinds = {
                    "/v1/traces": (
                        ExportTraceServiceRequest,
                        ExportTraceServiceResponse,
                        collector.traces,
                    ),
                    "/v1/metrics": (
                        ExportMetricsServiceRequest,
                        ExportMetricsServiceResponse,
                        collector.metrics,
                    ),
                }
                if self.path not in kinds:
                    self.send_error(404)
                    return
                req_cls, resp_cls, store = kinds[self.path]
                try:
                    msg = req_cls.FromString(body)
                except Exception as e:
                    with collector.lock:
                        collector.errors.append(f"{self.path}: {e}")
                    self.send_error(400)
                    return
                with collector.lock:
                    store.append(msg)
                out = resp_cls().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    # -- decoded views ---------------------------------------------------------------
    def spans(self) -> list[dict]:
        out = []
        with self.lock:
            reqs = list(self.traces)
        for req in reqs:
            for rs in req.resource_spans:
                res = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append(
                            {
                                "name": s.name,
                                "trace_id": s.trace_id.hex(),
                                "span_id": s.span_id.hex(),
                                "parent_id": s.parent_span_id.hex() or None,
                                "service": res.get("service.name", ""),
                                "attributes": {a.key: _any(a.value) for a in s.attributes},
                            }
                        )
        return out

    def metric_points(self) -> dict[tuple[str, str], list[tuple[dict, float]]]:
        """{(service, metric name): data points of the latest export of that service}."""
        with self.lock:
            reqs = list(self.metrics)
        out: dict[tuple[str, str], list[tuple[dict, float]]] = {}
        for req in reqs:  # later exports overwrite earlier ones
            for rm in req.resource_metrics:
                svc = {a.key: a.value.string_value for a in rm.resource.attributes}.get(
                    "service.name", ""
                )
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        pts = getattr(m, kind).data_points if kind in ("sum", "gauge") else []
                        out[(svc, m.name)] = [
                            (
                                {a.key: _any(a.value) for a in p.attributes},
                                p.as_double if p.WhichOneof("value") == "as_double" else p.as_int,
                            )
                            for p in pts
                        ]
        return out


def _any(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_any(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("otlp")
    mp = pytest.MonkeyPatch()
    with Collector() as collector:
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.port}")
        mp.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        mp.setenv("OTEL_METRIC_EXPORT_INTERVAL", "500")
        for var in (
            "KVMESH_TRACE_FILE",
            "KVMESH_METRICS_FILE",
            "OTEL_METRICS_EXPORTER",
            "OTEL_TRACES_EXPORTER",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
            "OTEL_EXPORTER_OTLP_HEADERS",
        ):
            mp.delenv(var, raising=False)
        cluster = LocalCluster(
            str(root / "cluster"), node_args=NODE_ARGS, http_port=-1, conductor_args=DISAGG_ONLY
        )
        try:
            cluster.start()
            yield cluster, collector
        finally:
            cluster.stop()
            mp.undo()


def _wait(what, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"collector never got {what}")


def test_spans_and_metrics_reach_the_collector(exported):
    # one retry with a fresh request: on a loaded 2-core machine an export can straddle
    # the checks (seen about once in three full-suite runs); a broken exporter fails both
    try:
        _check_export(exported, "otlp-req-1")
    except AssertionError:
        _check_export(exported, "otlp-req-2")


def _check_export(exported, rid: str) -> None:
    cluster, collector = exported
    r = generate(cluster.conductor, PROMPT, max_tokens=4, request_id=rid)
    assert len(r.tokens) == 4

    def trace_of_request():
        spans = collector.spans()
        roots = [
            s
            for s in spans
            if s["name"] == "kvmesh.v1.Conductor/Generate"
            and s["attributes"].get("kvmesh.request_id") == rid
        ]
        if not roots:
            return None
        mine = [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]
        names = {s["name"] for s in mine}
        want = {"conductor.admission", "kvmesh.v1.DecodeNode/Decode", "decode.generate"}
        return mine if want <= names else None

    spans = _wait(f"the spans of {rid}", trace_of_request)
    by_id = {s["span_id"]: s for s in spans}
    adm = next(s for s in spans if s["name"] == "conductor.admission")
    assert by_id[adm["parent_id"]]["name"] == "kvmesh.v1.Conductor/Generate"
    assert adm["attributes"]["kvmesh.admitted"] is True
    assert adm["service"] == "kvmesh-conductor"
    assert {"kvmesh-conductor", "kvmesh-decode"} <= {s["service"] for s in spans}

    # Metrics: the conductor's counters and histograms, the nodes' live state.
    def conductor_metrics():
        pts = collector.metric_points()
        acc = pts.get(("kvmesh-conductor", "kvmesh_requests_accepted_total"), [])
        ttft = pts.get(("kvmesh-conductor", "kvmesh_ttft_seconds_count"), [])
        if acc and acc[0][1] >= 1 and ttft and ttft[0][1] >= 1:
            return pts
        return None

    pts = _wait("kvmesh_requests_accepted_total >= 1 from the conductor", conductor_metrics)
    assert any(v > 0 for _, v in pts[("kvmesh-conductor", "kvmesh_ttft_seconds_bucket")])
    assert all("le" in a for a, _ in pts[("kvmesh-conductor", "kvmesh_ttft_seconds_bucket")])
    assert {"kvmesh-decode", "kvmesh-prefill", "kvmesh-store-master"} <= {s for s, _ in pts}
    blocks = pts.get(("kvmesh-decode", "kvmesh_kv_blocks"), [])
    assert any(a.get("state") == "free" and v > 0 for a, v in blocks), blocks
    assert any(v > 0 for _, v in pts.get(("kvmesh-store-master", "kvmesh_store_bytes"), []))
    assert all(name.startswith("kvmesh_") for _, name in pts)
    assert not collector.errors
