"""Per-run metrics from request records (real cluster or simulator).

A record is a dict (or :class:`kvmesh.loadtest.driver.Record`) with at least ``status`` ("OK"
when served), ``ttft_ms``, ``token_times_ms`` (per token, from when it was sent),
``prompt_tokens``, ``cached_tokens``, ``computed_tokens``, ``sent_ms``/``e2e_ms``.

- TTFT and TBT quantiles (p50/p90/p99) over served requests; TBT over every gap between
  consecutive tokens (tokens that arrive in one chunk split the chunk's gap evenly);
- acceptance rate: served / sent (rejections are RESOURCE_EXHAUSTED before any work);
- SLO attainment: served requests with TTFT <= SLO and mean TBT <= SLO, over *sent*
  requests (a rejected request did not attain its SLO) and over accepted ones;
- goodput: requests finished inside their SLOs per second of the run;
- cache hit ratio: cached_tokens / prompt_tokens over served requests; prefill tokens
  avoided = sum of cached_tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, is_dataclass


def quantile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated quantile (numpy's default); None for an empty list."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _d(r) -> dict:
    return asdict(r) if is_dataclass(r) else r


def tbt_gaps(token_times_ms: list[float]) -> list[float]:
    """Gaps between consecutive tokens; a chunk of k tokens at once shares its gap."""
    gaps: list[float] = []
    i, n = 1, len(token_times_ms)
    prev = token_times_ms[0] if n else 0.0
    while i < n:
        j = i
        while j + 1 < n and token_times_ms[j + 1] == token_times_ms[i]:
            j += 1
        k = j - i + 1
        gaps.extend([(token_times_ms[i] - prev) / k] * k)
        prev = token_times_ms[i]
        i = j + 1
    return gaps


def mean_tbt(r: dict) -> float | None:
    t = r.get("token_times_ms") or []
    if len(t) < 2:
        return r.get("tbt_ms")  # simulator records carry it directly
    return (t[-1] - t[0]) / (len(t) - 1)


def met_slo(r: dict, ttft_slo_ms: float, tbt_slo_ms: float) -> bool:
    if r.get("status") != "OK" or r.get("ttft_ms") is None:
        return False
    tbt = mean_tbt(r)
    return r["ttft_ms"] <= ttft_slo_ms and (tbt is None or tbt <= tbt_slo_ms)


def _rejected(r: dict) -> bool:
    """Refused by admission before any work: busy (RESOURCE_EXHAUSTED), or an SLO no node
    could ever meet (INVALID_ARGUMENT, reason ``infeasible``)."""
    status = r.get("status")
    return status == "RESOURCE_EXHAUSTED" or (
        status == "INVALID_ARGUMENT" and r.get("reject_reason") == "infeasible"
    )


def summarize(
    records: Iterable, *, ttft_slo_ms: float, tbt_slo_ms: float, duration_s: float | None = None
) -> dict:
    rs = [_d(r) for r in records]
    served = [r for r in rs if r.get("status") == "OK" and r.get("ttft_ms") is not None]
    rejected = [r for r in rs if _rejected(r)]
    failed = [
        r
        for r in rs
        if (r.get("status") != "OK" and not _rejected(r))
        or (r.get("status") == "OK" and r.get("ttft_ms") is None)
    ]
    ttft = [r["ttft_ms"] for r in served]
    gaps: list[float] = []
    for r in served:
        if r.get("token_times_ms"):
            gaps.extend(tbt_gaps(r["token_times_ms"]))
        elif r.get("tbt_ms") is not None:
            gaps.append(r["tbt_ms"])
    good = [r for r in served if met_slo(r, ttft_slo_ms, tbt_slo_ms)]
    if duration_s is None:
        ends = [r.get("sent_ms", 0.0) + (r.get("e2e_ms") or r.get("ttft_ms") or 0.0) for r in rs]
        starts = [r.get("sent_ms", 0.0) for r in rs]
        duration_s = (max(ends) - min(starts)) / 1000.0 if rs else 0.0
    prompt = sum(r.get("prompt_tokens", 0) for r in served)
    cached = sum(r.get("cached_tokens", 0) for r in served)
    computed = sum(r.get("computed_tokens", 0) for r in served)
    reasons: dict[str, int] = {}
    for r in rejected:
        k = r.get("reject_reason") or "unknown"
        reasons[k] = reasons.get(k, 0) + 1
    routes: dict[str, int] = {}
    for r in served:
        k = r.get("route") or "unknown"
        routes[k] = routes.get(k, 0) + 1

    def q3(xs):
        return {f"p{int(q * 100)}": rounded(quantile(xs, q)) for q in (0.5, 0.9, 0.99)}

    n = len(rs)
    return {
        "requests": n,
        "served": len(served),
        "rejected": len(rejected),
        "failed": len(failed),
        "rejected_by_reason": reasons,
        "routes": routes,
        "acceptance_rate": rounded(len(served) / n if n else None),
        "ttft_ms": {**q3(ttft), "mean": rounded(sum(ttft) / len(ttft) if ttft else None)},
        "tbt_ms": {**q3(gaps), "mean": rounded(sum(gaps) / len(gaps) if gaps else None)},
        "slo": {"ttft_ms": ttft_slo_ms, "tbt_ms": tbt_slo_ms},
        "slo_attainment": rounded(len(good) / n if n else None),
        "slo_attainment_accepted": rounded(len(good) / len(served) if served else None),
        "duration_s": rounded(duration_s),
        "goodput_rps": rounded(len(good) / duration_s if duration_s else None),
        "throughput_rps": rounded(len(served) / duration_s if duration_s else None),
        "offered_rps": rounded(n / duration_s if duration_s else None),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": computed,
        "cache_hit_ratio": rounded(cached / prompt if prompt else None),
        "prefill_tokens_avoided": cached,
        "completion_tokens": sum(r.get("completion_tokens", 0) for r in served),
    }


def rounded(x, nd: int = 4):
    return None if x is None else round(float(x), nd)


def ratio(a, b) -> float | None:
    """a / b, None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)
