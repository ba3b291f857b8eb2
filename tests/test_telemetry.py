"""Traces and metrics of a real request through a real cluster (separate processes).

Every service writes its finished spans as JSON lines (KVMESH_TRACE_FILE=<dir>/), and the
test rebuilds the request's span tree across the processes' files by trace and parent ids.
"""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest

from kvmesh.services.common.telemetry import read_spans
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, generate, status
from tests.grpc_util import KINDS, METHOD, call, in_thread, probe_handler, serving

pytestmark = pytest.mark.timeout(120)

PROMPT = "The quick brown fox jumps over the lazy dog; " * 2  # several 16-token blocks


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    root = tmp_path_factory.mktemp("telemetry")
    traces = root / "traces"
    traces.mkdir()
    mp = pytest.MonkeyPatch()
    mp.setenv("KVMESH_TRACE_FILE", str(traces) + "/")
    mp.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    cluster = LocalCluster(
        str(root / "cluster"), node_args=NODE_ARGS, http_port=-1, conductor_args=DISAGG_ONLY
    )  # the route that crosses every service
    try:
        cluster.start()
        yield cluster, str(traces)
    finally:
        cluster.stop()
        mp.undo()


def _trace_of(traces: str, request_id: str, want: set[str], timeout: float = 30):
    """The spans of the trace whose Generate span carries ``request_id``, once every name
    in ``want`` is there (spans are written when they end)."""
    deadline = time.monotonic() + timeout
    spans: list[dict] = []
    while time.monotonic() < deadline:
        spans = read_spans(traces)
        roots = [
            s
            for s in spans
            if s["name"] == "kvmesh.v1.Conductor/Generate"
            and s["attributes"].get("kvmesh.request_id") == request_id
        ]
        if roots:
            tid = roots[0]["trace_id"]
            mine = [s for s in spans if s["trace_id"] == tid]
            ids = {s["span_id"] for s in mine}
            # every wanted name, and every parent exported too (a span is written when it
            # ends, so a child may be on file before its still-open parent)
            if want <= {s["name"] for s in mine} and all(
                s["parent_id"] is None or s["parent_id"] in ids for s in mine
            ):
                return mine
        time.sleep(0.2)
    raise AssertionError(
        f"trace of {request_id} incomplete; names seen: {sorted({s['name'] for s in spans})}"
    )


def test_one_trace_spans_every_service(traced):
    cluster, traces = traced
    r = generate(cluster.conductor, PROMPT, max_tokens=4, request_id="trace-req-1")
    assert r.finish_reason and len(r.tokens) == 4
    disagg = bool(r.route.prefill_node)
    want = {
        "kvmesh.v1.Conductor/Generate",
        "conductor.admission",
        "kvmesh.v1.DecodeNode/Reserve",
        "kvmesh.v1.DecodeNode/Decode",
        "decode.generate",
    }
    if disagg:  # the store is called by the prefill node (the conductor follows its events)
        want |= {
            "kvmesh.v1.PrefillNode/Prefill",
            "prefill.queue",
            "prefill.prefix_fetch",
            "prefill.compute",
            "prefill.kv_handoff",
            # a model node lends no memory: its small KV puts commit into slots it holds
            # (services/store/remote_pool.py), one traced PutSlots frame per put
            "kvmesh.v1.StoreMaster/PutSlots",
        }
    spans = _trace_of(traces, "trace-req-1", want)
    by_id = {s["span_id"]: s for s in spans}

    # One root, and every other span's parent is in the same trace (across processes).
    roots = [s for s in spans if s["parent_id"] is None]
    assert [s["name"] for s in roots] == ["kvmesh.v1.Conductor/Generate"]
    root = roots[0]
    for s in spans:
        if s is not root:
            assert s["parent_id"] in by_id, f"{s['name']} ({s['service']}) has a foreign parent"

    def parent(s):
        return by_id[s["parent_id"]]

    def one(name, service=None, kind=None):
        found = [
            s
            for s in spans
            if s["name"] == name
            and (service is None or s["service"] == service)
            and (kind is None or s["kind"] == kind)
        ]
        assert len(found) == 1, (name, service, kind, found)
        return found[0]

    services = {s["service"] for s in spans}
    assert {"kvmesh-conductor", "kvmesh-decode", "kvmesh-store-master"} <= services
    assert root["attributes"]["kvmesh.route.decode"] == r.route.decode_node

    adm = one("conductor.admission")
    assert parent(adm) is root
    assert adm["attributes"]["kvmesh.admitted"] is True
    assert adm["attributes"]["kvmesh.candidates"], "candidates recorded"
    assert len(adm["attributes"]["kvmesh.candidate_ttft_ms"]) == len(
        adm["attributes"]["kvmesh.candidates"]
    )
    assert adm["attributes"]["kvmesh.estimated_ttft_ms"] > 0

    # gRPC hops: conductor CLIENT span -> node SERVER span.
    for name, svc in [
        ("kvmesh.v1.DecodeNode/Reserve", "kvmesh-decode"),
        ("kvmesh.v1.DecodeNode/Decode", "kvmesh-decode"),
    ]:
        servers = [
            s for s in spans if s["name"] == name and s["service"] == svc and s["kind"] == "SERVER"
        ]
        assert any(
            parent(s)["kind"] == "CLIENT"
            and parent(s)["service"] == "kvmesh-conductor"
            and parent(parent(s)) is root
            for s in servers
        ), name
    decode_srv = one("kvmesh.v1.DecodeNode/Decode", "kvmesh-decode", "SERVER")
    dec = one("decode.generate")
    assert parent(dec) is decode_srv and dec["attributes"]["kvmesh.tokens"] >= 1

    if disagg:
        pre = one("kvmesh.v1.PrefillNode/Prefill", "kvmesh-prefill", "SERVER")
        assert parent(pre)["kind"] == "CLIENT" and parent(parent(pre)) is root
        for name in (
            "prefill.queue",
            "prefill.prefix_fetch",
            "prefill.compute",
            "prefill.kv_handoff",
        ):
            assert parent(one(name)) is pre, name
        compute = one("prefill.compute")
        assert compute["attributes"]["kvmesh.new_tokens"] > 0
        assert any(e["name"].startswith("layer ") for e in compute["events"]), "per-layer events"
        assert one("prefill.kv_handoff")["attributes"]["kvmesh.bytes"] > 0
        # The store calls of the prefill node are in the same trace.
        assert any(
            s["name"].startswith("kvmesh.v1.StoreMaster/")
            and s["kind"] == "CLIENT"
            and s["service"] == "kvmesh-prefill"
            and parent(s) is pre
            for s in spans
        )
    else:
        assert any(s["name"] == "decode.prefill_here" for s in spans)
    # Times are sane: children start within the root.
    for s in spans:
        assert s["end_ns"] >= s["start_ns"]
        assert s["start_ns"] >= root["start_ns"] - 5_000_000


def _scrape(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _sum(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k == prefix or k.startswith(prefix + "{"))


def test_metrics_and_status(traced):
    cluster, _ = traced
    r = generate(cluster.conductor, PROMPT + "again", max_tokens=5)
    assert len(r.tokens) == 5
    with pytest.raises(grpc.RpcError) as e:  # an SLO no node can meet: rejected early
        generate(cluster.conductor, PROMPT, max_tokens=4, slo={"ttft_ms": 0.001})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # below the floor
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.conductor, "", max_tokens=4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    st = status(cluster.conductor)
    nodes = {n.role: n for n in st.nodes}
    for n in st.nodes:
        assert n.metrics_address, f"{n.node_id} advertises no metrics port"
    assert st.requests_accepted >= 1 and st.requests_rejected >= 2
    assert st.rejected_by_reason.get("invalid_argument", 0) >= 1
    assert st.rejected_by_reason.get("infeasible", 0) >= 1
    assert st.ttft_p50_ms > 0 and st.ttft_p99_ms >= st.ttft_p50_ms
    assert st.tbt_p50_ms > 0
    assert st.top_routes and st.top_routes[0].decode_node == nodes["decode"].node_id
    assert 0 < st.slo_attainment <= 1

    c = _scrape(nodes["conductor"].metrics_address)
    assert c["kvmesh_ttft_seconds_count"] >= 1
    assert c["kvmesh_tbt_seconds_count"] >= 4
    assert c["kvmesh_requests_accepted_total"] >= 1
    assert _sum(c, "kvmesh_requests_rejected_total") >= 2
    assert c['kvmesh_requests_rejected_total{reason="invalid_argument"}'] >= 1
    assert c['kvmesh_slo_requests_total{attained="true",slo="ttft"}'] >= 1
    assert _sum(c, "kvmesh_route_requests_total") >= 1
    assert c["kvmesh_ttft_estimate_error_seconds_count"] >= 1
    assert c['kvmesh_request_prompt_tokens_total{kind="computed"}'] > 0

    d = _scrape(nodes["decode"].metrics_address)
    node = nodes["decode"].node_id
    assert d[f'kvmesh_kv_blocks{{node="{node}",role="decode",state="free"}}'] > 0
    assert f'kvmesh_running_requests{{node="{node}"}}' in d
    assert d[f'kvmesh_generated_tokens_total{{node="{node}"}}'] >= 1

    s = _scrape(nodes["store-master"].metrics_address)
    assert s['kvmesh_store_bytes{state="capacity"}'] > 0
    assert "kvmesh_store_blocks" in s

    p = _scrape(nodes["prefill"].metrics_address)
    node = nodes["prefill"].node_id
    assert f'kvmesh_queue_depth{{node="{node}",role="prefill"}}' in p
    assert f'kvmesh_prefill_tokens_avoided_total{{node="{node}"}}' in p
    if r.route.prefill_node:
        assert p[f'kvmesh_prefill_tokens_total{{kind="computed",node="{node}"}}'] > 0
        assert p['kvmesh_transfer_bytes_total{path="handoff"}'] > 0
        assert p['kvmesh_transfer_seconds_count{path="handoff"}'] >= 1
        assert p["kvmesh_prefill_seconds_count"] >= 1


def test_status_cli_once_and_json(traced):
    import json
    import subprocess
    import sys

    cluster, _ = traced
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.services.cli",
            "status",
            "--conductor",
            cluster.conductor,
            "--once",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "TTFT p50/p90/p99" in out.stdout and "acceptance" in out.stdout
    js = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.services.cli",
            "status",
            "--conductor",
            cluster.conductor,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    data = json.loads(js.stdout)
    assert "ttft_p50_ms" in data and all(n.get("metrics_address") for n in data["nodes"])
    # --watch refreshes until interrupted. Each wait is on its condition (a frame, the
    # exit), bounded generously: a busy machine makes it slow, not wrong.
    w = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvmesh.services.cli",
            "status",
            "--conductor",
            cluster.conductor,
            "--watch",
            "--interval",
            "0.3",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    import signal
    import threading

    lines: list[str] = []

    def read() -> None:
        for line in w.stdout:
            lines.append(line)

    def wait_frames(n: int, within: float) -> None:
        deadline = time.monotonic() + within
        while sum("kvmesh status" in line for line in lines) < n:
            if w.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no frame {n} in {within:g} s: " + "".join(lines)[:500])
            time.sleep(0.05)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_frames(1, 120)  # the first output: start-up plus one ClusterStatus
        wait_frames(2, 60)  # it refreshes
        w.send_signal(signal.SIGINT)
        w.wait(timeout=60)
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
    reader.join(10)
    text = "".join(lines)
    assert w.returncode == 0
    assert text.count("kvmesh status") >= 2, text[:500]


def test_grafana_dashboard_uses_exported_metrics(traced):
    import json
    import re
    from pathlib import Path

    cluster, _ = traced
    names: set[str] = set()
    for n in status(cluster.conductor).nodes:
        text = (
            urllib.request.urlopen(f"http://{n.metrics_address}/metrics", timeout=5).read().decode()
        )
        names |= {
            line.split()[0].split("{")[0]
            for line in text.splitlines()
            if line.startswith("kvmesh_")
        }
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}
        for line in text.splitlines():  # families without samples yet (no label values seen)
            if line.startswith("# TYPE kvmesh_"):
                _, _, base, kind = line.split()
                names |= {base} | {base + sfx for sfx in suffixes.get(kind, [])}
    dash = json.loads((Path(__file__).parent.parent / "deploy/grafana/kvmesh.json").read_text())
    used = {
        m
        for p in dash["panels"]
        for t in p["targets"]
        for m in re.findall(r"\bkvmesh_[a-z_]+", t["expr"])
    }
    assert used and used <= names, f"dashboard uses metrics nobody exports: {sorted(used - names)}"


@pytest.mark.parametrize("kind", KINDS)
def test_server_span_covers_every_rpc_kind(kind, monkeypatch):
    """A real server with the tracing interceptor: a call of each kind (client-streaming
    too) runs its handler inside a SERVER span named after the method."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvmesh.services.common import telemetry

    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(telemetry, "_enabled", True)  # this process's provider stays global
    monkeypatch.setattr(telemetry, "tracer", lambda: provider.get_tracer("test"))
    service = "kvmesh.v1.Conductor"
    current = lambda: trace.get_current_span().name.encode()  # noqa: E731 - SDK spans have it
    handler = probe_handler(service, current)

    async def main():
        async with serving([handler], [telemetry.ServerInterceptor()]) as ch:
            return await call(ch, service, kind)

    seen = in_thread(main())
    name = f"{service}/{METHOD[kind]}"
    assert seen and set(seen) == {name.encode()}
    finished = spans.get_finished_spans()
    assert [(s.name, s.kind.name) for s in finished] == [(name, "SERVER")]
