"""Tracing for kvmesh: one trace per request across every service it touches.

Off unless asked for. ``setup_tracing(role, node_id)`` (called by ``Service``) installs an
OpenTelemetry tracer provider only when one of these is set:

  OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
      export spans over OTLP (the exporter package is imported lazily: install
      ``opentelemetry-exporter-otlp-proto-grpc`` or ``-proto-http``; the standard
      OTEL_EXPORTER_OTLP_* variables configure it);
  KVMESH_TRACE_FILE=/path
      test/debug mode: every finished span is appended as one JSON line. If the path is
      a directory (or ends with "/"), each process writes ``<role>-<pid>.jsonl`` in it.

Otherwise the OpenTelemetry API stays a no-op and no interceptor is installed.
The same call starts the OpenTelemetry *metrics* export (``kvmesh.services.common.otel_metrics``:
the Prometheus registry bridged to OTel instruments) under the same OTLP variables, or
KVMESH_METRICS_FILE; ``shutdown_tracing`` flushes both.

Context crosses processes as W3C ``traceparent`` in gRPC metadata: a client interceptor
(added to every ``grpc.aio.insecure_channel`` of the process) starts a CLIENT span per
kvmesh RPC and injects its context; a server interceptor (added to the service's
``grpc.aio`` server) extracts it and runs the handler inside a SERVER span. Services add
INTERNAL spans for the phases of a request (admission, queueing, prefix fetch, prefill,
KV handoff, KV wait, decode) with :func:`record_span` / ``tracer()``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvmesh.services.common import otel_metrics
from kvmesh.services.common.interceptors import wrap_handler
from kvmesh.services.common.otlp import otlp_exporter, read_jsonl

log = logging.getLogger(__name__)

TRACER_NAME = "kvmesh"
_enabled = False
_provider = None
_patched = False


def enabled() -> bool:
    return _enabled


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


# ------------------------------------------------------------------ exporters


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON line (one ``write`` per span, O_APPEND)."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        lines = "".join(json.dumps(span_to_dict(s), default=str) + "\n" for s in spans)
        with self._lock:
            if self._fd >= 0:
                os.write(self._fd, lines.encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_to_dict(s: Any) -> dict[str, Any]:
    ctx = s.get_span_context()
    parent = s.parent
    res = dict(s.resource.attributes) if s.resource is not None else {}
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": s.name,
        "kind": s.kind.name,
        "service": res.get("service.name", ""),
        "node": res.get("service.instance.id", ""),
        "start_ns": s.start_time,
        "end_ns": s.end_time,
        "status": s.status.status_code.name,
        "attributes": dict(s.attributes or {}),
        "events": [
            {"name": e.name, "ts": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in s.events
        ],
    }


def read_spans(path: str) -> list[dict[str, Any]]:
    """All spans written by :class:`JsonLinesSpanExporter` under ``path`` (a file or a
    directory of ``*.jsonl``)."""
    return read_jsonl(path)


def _otlp_exporter():
    return otlp_exporter("traces")


def _setup_metrics(role: str, node_id: str) -> None:
    """OpenTelemetry export of the kvmesh_* metrics (``kvmesh.services.common.otel_metrics``)."""
    try:
        otel_metrics.setup_metrics(role, node_id)
    except Exception:  # broad on purpose: metrics export is optional, a service starts anyway
        log.exception("OpenTelemetry metrics not started")


def setup_tracing(role: str, node_id: str) -> bool:
    """Installs the tracer provider and the gRPC client interceptors if an exporter is
    configured (see the module doc); returns whether tracing is on. Idempotent."""
    global _enabled, _provider
    _setup_metrics(role, node_id)
    if _enabled:
        return True
    trace_file = os.environ.get("KVMESH_TRACE_FILE", "")
    otlp = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )
    if not trace_file and not otlp:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(
        resource=Resource.create({"service.name": f"kvmesh-{role}", "service.instance.id": node_id})
    )
    if trace_file:
        if trace_file.endswith("/") or os.path.isdir(trace_file):
            trace_file = os.path.join(trace_file, f"{role}-{os.getpid()}.jsonl")
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(trace_file)))
    if otlp:
        exporter = _otlp_exporter()
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    _enabled = True
    patch_grpc_channels()
    return True


def shutdown_tracing() -> None:
    otel_metrics.shutdown_metrics()
    if _provider is not None:
        try:
            _provider.shutdown()
        # broad on purpose: span processors and exporters may raise anything (an
        # unreachable collector) and must not block the service's shutdown
        except Exception:
            log.exception("flushing traces failed")


# ------------------------------------------------------------------ spans


def record_span(
    name: str,
    start_ns: int,
    end_ns: int | None = None,
    attributes: dict[str, Any] | None = None,
    error: str | None = None,
    events: Iterable[tuple[str, int, dict]] = (),
) -> None:
    """Records a finished INTERNAL span after the fact, child of the current span (cheap
    to call on hot paths: a no-op when tracing is off)."""
    if not _enabled:
        return
    span = tracer().start_span(name, start_time=start_ns, attributes=_clean(attributes))
    for ev_name, ts, attrs in events:
        span.add_event(ev_name, _clean(attrs), timestamp=ts)
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


def set_attributes(attributes: dict[str, Any]) -> None:
    """Sets attributes on the current span (the request's span)."""
    if _enabled:
        trace.get_current_span().set_attributes(_clean(attributes))


def _clean(attrs: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (attrs or {}).items():
        if isinstance(v, (str, bool, int, float)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(
            isinstance(x, (str, bool, int, float)) for x in v
        ):
            out[k] = list(v)
        elif v is not None:
            out[k] = str(v)
    return out


# ------------------------------------------------------------------ gRPC propagation


def _traced(method: str) -> bool:
    return method.startswith("/kvmesh.")


def _span_name(method: str) -> str:
    return method.lstrip("/")


class _ClientInterceptor:
    """A CLIENT span per kvmesh RPC; its context goes out as ``traceparent`` metadata.
    (grpc.aio files an interceptor under one call type only, so each type gets a subclass.)"""

    def _start(self, details):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if not _traced(method):
            return None, details
        span = tracer().start_span(
            _span_name(method),
            kind=SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.method": method},
        )
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        md = grpc.aio.Metadata(*tuple(details.metadata or ()))
        for k, v in carrier.items():
            md.add(k, v)
        return span, details._replace(metadata=md)

    @staticmethod
    def _finish(span, call) -> None:
        def done(_):
            span.end()

        try:
            call.add_done_callback(done)
        except AttributeError:  # a call object without callbacks: end the span now
            span.end()

    async def intercept_unary_unary(self, continuation, details, request):
        span, details = self._start(details)
        if span is None:
            return await continuation(details, request)
        try:
            call = await continuation(details, request)
        except BaseException:
            span.end()
            raise
        self._finish(span, call)
        return call

    # a streaming call is traced the same way: the span ends when the call is done
    intercept_unary_stream = intercept_unary_unary


class _UnaryUnary(_ClientInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    pass


class _UnaryStream(_ClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    pass


def client_interceptors() -> list:
    return [_UnaryUnary(), _UnaryStream()] if _enabled else []


def patch_grpc_channels() -> None:
    """Adds the client interceptor to every later ``grpc.aio.insecure_channel`` of this
    process (the services create their channels through it)."""
    global _patched
    if _patched:
        return
    _patched = True
    original = grpc.aio.insecure_channel

    def insecure_channel(target, options=None, compression=None, interceptors=None):
        return original(
            target,
            options=options,
            compression=compression,
            interceptors=[*client_interceptors(), *(interceptors or [])],
        )

    grpc.aio.insecure_channel = insecure_channel


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Runs each kvmesh RPC inside a SERVER span whose parent comes from ``traceparent``."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not _enabled or not _traced(details.method):
            return handler
        name = _span_name(details.method)
        md = details.invocation_metadata or ()
        carrier = {k: v for k, v in md if isinstance(v, str)}

        @contextlib.asynccontextmanager
        async def server_span(ctx):
            with tracer().start_as_current_span(
                name,
                context=propagate.extract(carrier),
                kind=SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.method": details.method},
            ):
                yield

        return wrap_handler(handler, server_span)


def current_context():
    return otel_context.get_current()
