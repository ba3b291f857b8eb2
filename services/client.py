"""Talking to a running cluster's conductor: stream a completion, read and format the
cluster's status. Shared by the ``kvmesh`` command line and ``kvmesh up``.

Several conductors serve one cluster at once (each keeps the whole cache index and
counts the others' work through the nodes' load reports), so a client takes several
addresses (``"a:50051,b:50051"``, or a list), or one that a load balancer (a Kubernetes
Service) spreads. The retry rule: a call that fails with ``UNAVAILABLE`` (the conductor
is down, restarting or died mid-call) before any token came back is sent again to the
next address (a single address is tried twice, for a Service to pick another pod), up to
``len(addresses) + 1`` attempts; nothing reached the caller, and a conductor that dies
frees what its request held on the nodes, so nothing is duplicated. Once a token has come
back, or on any other status (bad input, early rejection), the error is the caller's.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from typing import TextIO

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common.auth import bearer_metadata
from kvmesh.services.common.channels import TlsFiles, make_channel

# gRPC target names that carry their own scheme (``dns:///svc:50051``, ``unix:/run/x``)
_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def check_address(addr: str) -> str:
    """``addr`` if it is ``HOST:PORT`` (``[v6]:PORT``) with a port in 1..65535, or a gRPC
    target with its own scheme (``dns:///HOST:PORT``, ``unix:PATH``); else ValueError
    naming what is wrong (grpc would take ``HOST`` as port 443, and a port past 65535
    modulo 65536)."""
    if addr.startswith(_SCHEMES):
        if addr.split(":", 1)[1].strip("/"):
            return addr
        raise ValueError(f"conductor address {addr!r} names no target after its scheme")
    if any(c.isspace() for c in addr):
        raise ValueError(f"conductor address {addr!r} contains a space; give HOST:PORT")
    host, sep, port = addr.rpartition(":")
    if not sep or (host.count(":") and not host.startswith("[")):
        raise ValueError(
            f"conductor address {addr!r} has no port; give HOST:PORT (e.g. 127.0.0.1:50051)"
        )
    if not host or host == "[]":
        raise ValueError(f"conductor address {addr!r} has no host; give HOST:PORT")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"conductor address {addr!r}: the port must be a number in 1..65535, got {port!r}"
        )
    return addr


def conductor_addresses(conductor: str | Sequence[str]) -> list[str]:
    """``"a:1,b:2"`` or ``["a:1", "b:2"]`` -> ``["a:1", "b:2"]`` (blanks dropped);
    ValueError if none is left or one is malformed (:func:`check_address`)."""
    items = conductor.split(",") if isinstance(conductor, str) else list(conductor)
    out = [check_address(a.strip()) for a in items if a.strip()]
    if not out:
        raise ValueError(
            f"no conductor address in {conductor!r}: give HOST:PORT[,HOST:PORT...] "
            "(e.g. 127.0.0.1:50051)"
        )
    return out


def _attempts(addrs: list[str]) -> list[str]:
    """The addresses to try, in order: each once, then the first again."""
    return addrs + addrs[:1]


def _retryable(e: grpc.aio.AioRpcError) -> bool:
    return e.code() == grpc.StatusCode.UNAVAILABLE


async def stream_completion(
    conductor: str | Sequence[str],
    req: pb.GenerateRequest,
    *,
    timeout: float = 300.0,
    api_key: str = "",
    tls: TlsFiles | None = None,
    verbose: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Writes the completion of ``req`` to ``out`` as it streams (its usage to ``err``
    with ``verbose``); returns the exit status: 0, or 1 on a gRPC error (printed).
    ``conductor``: one address or several (comma-separated or a list), tried in turn
    by the module's retry rule (a retry is noted on ``err``)."""
    out = out or sys.stdout
    err = err or sys.stderr
    addrs = _attempts(conductor_addresses(conductor))
    for i, addr in enumerate(addrs):
        last = None
        async with make_channel(addr, tls) as ch:
            try:
                async for r in pbg.ConductorStub(ch).Generate(
                    req, timeout=timeout, metadata=bearer_metadata(api_key)
                ):
                    out.write(r.text)
                    out.flush()
                    last = r
            except grpc.aio.AioRpcError as e:
                if last is None and _retryable(e) and i + 1 < len(addrs):
                    print(
                        f"conductor {addr}: {e.code().name}; retrying on {addrs[i + 1]}",
                        file=err,
                    )
                    await asyncio.sleep(0.1 * (i + 1))
                    continue
                print(f"\nerror: {e.code().name} (conductor {addr}): {e.details()}", file=err)
                return 1
        out.write("\n")
        if last is not None and verbose:
            u = last.usage
            print(
                f"[{last.finish_reason}] prompt={u.prompt_tokens} completion="
                f"{u.completion_tokens} cached={u.cached_tokens} computed={u.computed_tokens}",
                file=err,
            )
        return 0
    return 1  # not reached: the last attempt returns


async def cluster_status(
    conductor: str | Sequence[str],
    timeout: float = 5,
    *,
    api_key: str = "",
    tls: TlsFiles | None = None,
) -> pb.ClusterStatusResponse:
    """The cluster's status from the first of the conductors that answers (a read: any
    UNAVAILABLE moves on to the next address)."""
    addrs = _attempts(conductor_addresses(conductor))
    for i, addr in enumerate(addrs):
        async with make_channel(addr, tls) as ch:
            try:
                return await pbg.ConductorStub(ch).ClusterStatus(
                    pb.ClusterStatusRequest(), timeout=timeout, metadata=bearer_metadata(api_key)
                )
            except grpc.aio.AioRpcError as e:
                if not _retryable(e) or i + 1 == len(addrs):
                    raise
    raise AssertionError("not reached")


def format_status(s: pb.ClusterStatusResponse) -> str:
    seen = s.requests_accepted + s.requests_rejected
    rate = f"{100 * s.requests_accepted / seen:.1f}%" if seen else "-"
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(s.rejected_by_reason.items()))
    rows = [
        f"cluster {s.cluster}: {len(s.nodes)} node(s); store {s.store_blocks} block(s), "
        f"{s.store_bytes_used / 2**20:.1f}/{s.store_bytes_total / 2**20:.1f} MiB"
        + (
            f" ({100 * s.store_bytes_used / s.store_bytes_total:.0f}% used)"
            if s.store_bytes_total
            else ""
        ),
        f"requests: {s.requests_accepted} accepted, {s.requests_rejected} rejected"
        + (f" ({reasons})" if reasons else "")
        + f"; acceptance {rate}; SLO attained "
        + (f"{100 * s.slo_attainment:.1f}%" if s.requests_accepted else "-"),
        f"latency (last {s.window_s or 300}s): TTFT p50/p90/p99 {s.ttft_p50_ms:.1f}/"
        f"{s.ttft_p90_ms:.1f}/{s.ttft_p99_ms:.1f} ms; TBT p50/p90/p99 {s.tbt_p50_ms:.1f}/"
        f"{s.tbt_p90_ms:.1f}/{s.tbt_p99_ms:.1f} ms",
    ]
    if s.top_routes:
        rows.append(
            "top routes: "
            + ", ".join(
                f"{r.prefill_node or '(on decode)'} -> {r.decode_node}: {r.requests}"
                for r in s.top_routes
            )
        )
    rows += [
        f"{'ROLE':<13} {'NODE':<28} {'GRPC':<22} {'KV FREE/TOTAL':>14} {'QUEUE':>6} "
        f"{'RUN':>4} {'COMPUTED':>9} {'CACHED':>8} {'FETCHED':>8} {'DECODED':>8} "
        f"{'CPU S @ BUDGET':>15}"
    ]
    for n in sorted(s.nodes, key=lambda n: (n.role, n.node_id)):
        kv = f"{n.kv_blocks_free}/{n.kv_blocks_total}" if n.kv_blocks_total else "-"
        state = "" if n.reachable else " (unreachable)"
        cpu = (
            f"{n.cpu_seconds:.1f} @ " + (f"{n.cpu_budget_cores:g}c" if n.cpu_budget_cores else "-")
            if n.role in ("prefill", "decode") and n.reachable
            else "-"
        )
        rows.append(
            f"{n.role:<13} {n.node_id[:28]:<28} {n.grpc_address:<22} {kv:>14} "
            f"{n.queue_depth:>6} {n.running:>4} {n.computed_tokens_total:>9} "
            f"{n.cached_tokens_total:>8} {n.fetched_tokens_total:>8} "
            f"{n.generated_tokens_total:>8} {cpu:>15}{state}"
        )
    return "\n".join(rows)


def format_endpoints(s: pb.ClusterStatusResponse) -> str:
    rows = [
        f"{n.role:<13} {n.node_id[:28]:<28} metrics http://{n.metrics_address}/metrics"
        + (f"  api http://{n.http_address}/v1" if n.http_address else "")
        for n in sorted(s.nodes, key=lambda n: (n.role, n.node_id))
        if n.metrics_address
    ]
    return "\n".join(rows)
