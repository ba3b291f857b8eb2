"""What the trace export (``telemetry``) and the metrics export (``otel_metrics``) share:
the choice of the OTLP exporter and reading back the JSON-lines files of the test/debug
exporters. Below both, so neither imports the other for it."""

from __future__ import annotations

import importlib
import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Every JSON line of ``path``, a file or a directory of ``*.jsonl`` files."""
    files = (
        [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".jsonl")]
        if os.path.isdir(path)
        else [path]
    )
    out: list[dict[str, Any]] = []
    for f in files:
        with open(f) as fh:
            out.extend(json.loads(line) for line in fh if line.strip())
    return out


_OTLP_MODULES = {  # signal -> (module suffix, exporter class)
    "traces": ("trace_exporter", "OTLPSpanExporter"),
    "metrics": ("metric_exporter", "OTLPMetricExporter"),
}


def otlp_exporter(signal: str = "traces"):
    """The OTLP exporter of ``signal`` ("traces" or "metrics"), or None if its package is
    missing. OTEL_EXPORTER_OTLP_<SIGNAL>_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL choose it
    ("grpc" or "http/protobuf"); unset, gRPC is tried first, then HTTP."""
    proto = (
        (
            os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or ""
        )
        .strip()
        .lower()
    )
    kinds = (
        ["http"] if proto.startswith("http") else ["grpc"] if proto == "grpc" else ["grpc", "http"]
    )
    module, cls = _OTLP_MODULES[signal]
    for kind in kinds:
        try:
            mod = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{kind}.{module}")
        except ImportError:
            continue
        return getattr(mod, cls)()
    pkg = " or ".join(f"opentelemetry-exporter-otlp-proto-{k}" for k in kinds)
    log.warning(
        "OTEL_EXPORTER_OTLP_ENDPOINT is set but no OTLP exporter (%s) is installed "
        "(pip install %s); not exporting %s",
        proto or "grpc/http",
        pkg,
        signal,
    )
    return None
