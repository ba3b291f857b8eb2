"""Request-level observability of the conductor, wrapped around ``Conductor.generate``
(used by both the gRPC servicer and the HTTP API, so every request is counted once):
TTFT and TBT histograms, SLO attainment, acceptance and rejection counts by reason,
routes, estimate error, token usage, vLLM's series (:mod:`.vllm_metrics`), and the
request span's attributes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common import metrics as m
from kvmesh.services.common import telemetry
from kvmesh.services.conductor.cluster import NodeInfo
from kvmesh.services.conductor.frontend import ConductorApi, Rejected
from kvmesh.services.conductor.vllm_metrics import RequestSeries


def rejection_reason(code: grpc.StatusCode, metadata) -> str:
    """The reason label of an early rejection: the scheduler's own reason when it gave one
    (``kvmesh-reject-reason`` metadata), else one derived from the status code."""
    md = dict(metadata or ())
    if md.get("kvmesh-reject-reason"):
        return str(md["kvmesh-reject-reason"]).replace("-", "_")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return "invalid_argument"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "ttft_slo" if "retry-after-ms" in md else "kv_reservation"
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unavailable"
    return code.name.lower()


def admission_attributes(r: Any, d: Any) -> dict[str, Any]:
    """Span attributes of the admission decision ``d`` for request ``r`` (candidates,
    their estimates, the chosen route)."""
    est = getattr(d, "estimate", None)
    cands = list(getattr(d, "candidates", None) or [])
    return {
        "kvmesh.request_id": getattr(r, "request_id", ""),
        "kvmesh.prompt_tokens": getattr(r, "prompt_tokens", getattr(r, "n_tokens", 0)) or 0,
        "kvmesh.admitted": bool(getattr(d, "accepted", False)),
        "kvmesh.reason": getattr(d, "reason", "") or "",
        "kvmesh.route": str(getattr(d, "route", "") or ""),
        "kvmesh.route.prefill": getattr(d, "prefill_node", "") or "",
        "kvmesh.route.decode": getattr(d, "decode_node", "") or "",
        "kvmesh.estimated_ttft_ms": float(est.ttft_ms) if est is not None else -1.0,
        **(
            {
                f"kvmesh.estimate.{k}_ms": float(getattr(est, f"{k}_ms", 0.0))
                for k in ("queue", "prefill", "fetch", "handoff")
            }
            if est is not None
            else {}
        ),
        "kvmesh.candidates": [f"{getattr(c, 'route', '')}:{getattr(c, 'node', '')}" for c in cands],
        "kvmesh.candidate_ttft_ms": [round(float(getattr(c, "ttft_ms", 0.0)), 3) for c in cands],
    }


async def observed(
    conductor: ConductorApi, req: pb.GenerateRequest, t_arrival: float | None = None
) -> AsyncGenerator[pb.GenerateResponse, None]:
    """``conductor.generate(req)`` with its metrics recorded on the way through; TTFT and
    end-to-end latency count from ``t_arrival`` (``time.perf_counter()`` when the request
    arrived: the HTTP API's before it reads and parses the body), else from now."""
    stats: m.RequestStats = conductor.request_stats
    cfg = conductor.cfg
    ttft_slo = cfg.ttft_slo_ms if req.slo.ttft_ms <= 0 else min(req.slo.ttft_ms, cfg.ttft_slo_ms)
    tbt_slo = cfg.tbt_slo_ms if req.slo.tbt_ms <= 0 else min(req.slo.tbt_ms, cfg.tbt_slo_ms)
    t0 = time.perf_counter() if t_arrival is None else t_arrival
    last = t0
    ttft = None
    gaps: list[float] = []
    finish = "cancelled"
    series = RequestSeries(conductor.model_label(req.model), t0)  # the vllm: series
    try:
        async for resp in conductor.generate(req):
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
                m.TTFT.observe(ttft)
                series.first_token(ttft)
                stats.add_ttft(ttft)
                m.REQUESTS_ACCEPTED.inc()
                stats.accepted += 1
                r = resp.route
                m.ROUTES.labels(r.prefill_node, r.decode_node).inc()
                stats.routes[(r.prefill_node, r.decode_node)] += 1
                if r.estimated_ttft_ms > 0:
                    est = r.estimated_ttft_ms / 1000
                    m.ESTIMATE_ERROR.observe(abs(ttft - est))
                    m.ESTIMATE_RATIO.observe(ttft / est)
                telemetry.set_attributes(
                    {
                        "kvmesh.request_id": resp.request_id,
                        "kvmesh.route.prefill": r.prefill_node,
                        "kvmesh.route.decode": r.decode_node,
                        "kvmesh.ttft_ms": ttft * 1000,
                        "kvmesh.estimated_ttft_ms": r.estimated_ttft_ms,
                    }
                )
            elif resp.token_ids:
                gap = (now - last) / len(resp.token_ids)
                series.gaps(gap, len(resp.token_ids))
                for _ in resp.token_ids:
                    m.TBT.observe(gap)
                    stats.add_tbt(gap)
                    gaps.append(gap)
            last = now
            if resp.finish_reason:
                finish = resp.finish_reason
                u = resp.usage
                m.PROMPT_TOKENS.labels("computed").inc(u.computed_tokens)
                m.PROMPT_TOKENS.labels("cached").inc(u.cached_tokens)
                m.GENERATED.inc(u.completion_tokens)
                series.usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
                telemetry.set_attributes(
                    {
                        "kvmesh.prompt_tokens": u.prompt_tokens,
                        "kvmesh.completion_tokens": u.completion_tokens,
                        "kvmesh.cached_tokens": u.cached_tokens,
                        "kvmesh.computed_tokens": u.computed_tokens,
                        "kvmesh.finish_reason": finish,
                    }
                )
            yield resp
    except Rejected as e:
        if ttft is None:
            reason = rejection_reason(e.code, e.metadata)
            m.REQUESTS_REJECTED.labels(reason).inc()
            stats.rejected[reason] += 1
            telemetry.set_attributes({"kvmesh.rejected": reason})
            finish = ""
        else:
            finish = "error"
        raise
    finally:
        series.finish(time.perf_counter())
        if finish:
            m.REQUESTS_FINISHED.labels(finish).inc()
        if ttft is not None and finish in ("stop", "length"):
            ok_ttft = ttft * 1000 <= ttft_slo
            mean_tbt = sum(gaps) / len(gaps) if gaps else 0.0
            ok_tbt = mean_tbt * 1000 <= tbt_slo
            m.SLO.labels("ttft", str(ok_ttft).lower()).inc()
            m.SLO.labels("tbt", str(ok_tbt).lower()).inc()
            stats.slo_total += 1
            stats.slo_met += int(ok_ttft and ok_tbt)


def fill_status(conductor: ConductorApi, out: pb.ClusterStatusResponse) -> None:
    """Adds the request summary and the nodes' metrics/HTTP addresses to a
    ``ClusterStatusResponse``."""
    s = conductor.request_stats.summary()
    out.requests_accepted = s["requests_accepted"]
    out.requests_rejected = s["requests_rejected"]
    for k, v in s["rejected_by_reason"].items():
        out.rejected_by_reason[k] = v
    out.slo_attainment = s["slo_attainment"]
    out.window_s = int(s["window_s"])
    for name in ("ttft", "tbt"):
        for q in (50, 90, 99):
            setattr(out, f"{name}_p{q}_ms", s[f"{name}_p{q}_ms"])
    for (p, d), n in s["top_routes"]:
        out.top_routes.append(pb.RouteCount(prefill_node=p, decode_node=d, requests=n))
    raw = {n.node_id: n.raw for n in conductor.view.nodes()}
    for n in out.nodes:
        info = raw.get(n.node_id, {})
        n.metrics_address = info.get("metrics", "")
        n.http_address = info.get("http", "")


async def cluster_status(conductor: ConductorApi, cluster: str) -> pb.ClusterStatusResponse:
    """``ClusterStatus``: every live node's own status (``reachable`` false for one that
    did not answer within a second), the store's totals and the request summary."""
    out = pb.ClusterStatusResponse(cluster=cluster)
    nodes = conductor.view.nodes()

    async def one(n: NodeInfo) -> pb.NodeStatus:
        base = pb.NodeStatus(
            node_id=n.node_id,
            role=n.role,
            grpc_address=n.grpc,
            data_address=n.raw.get("data", ""),
            model=n.model,
            fingerprint=n.fingerprint,
            reachable=True,
        )
        stub = (
            conductor.view.prefill_stub(n)
            if n.role == "prefill"
            else conductor.view.decode_stub(n)
            if n.role == "decode"
            else None
        )
        if stub is None:
            return base
        try:
            return await stub.Status(pb.NodeStatusRequest(), timeout=1)
        except grpc.aio.AioRpcError:
            base.reachable = False
            return base

    out.nodes.extend(await asyncio.gather(*(one(n) for n in nodes)))
    stub = conductor.view.store_stub()
    if stub is not None:
        try:
            s = await stub.Stats(pb.StoreStatsRequest(), timeout=1)
            out.store_blocks, out.store_bytes_used, out.store_bytes_total = (
                s.blocks,
                s.bytes_used,
                s.bytes_total,
            )
        except grpc.aio.AioRpcError:
            pass
    fill_status(conductor, out)
    return out
