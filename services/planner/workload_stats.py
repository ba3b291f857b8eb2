"""A workload's token statistics and prefix reuse: the planner's workload input.

:class:`WorkloadStats` comes from a Mooncake-format trace (:meth:`WorkloadStats.from_trace`,
JSON Lines of ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``), from the
load generator's items (:meth:`WorkloadStats.from_workload_items`: exactly what a run
sends) or from plain ``(prompt_tokens, output_tokens, shared_prefix_tokens[, group])``
tuples (:meth:`WorkloadStats.from_items`).

**Prefix reuse.** Every request becomes a chain of block keys, one per whole
``block_size``-token block of its prompt (a key stands for its block and everything
before it, as a trace hash id does). In arrival order, a request hits the leading blocks
whose keys a cache already holds (its last token is always computed) and then adds its
own; a cache of limited size evicts the least recently used blocks. ``reuse`` is hit
tokens / prompt tokens with one cache of ``shared_cache_tokens`` (default unbounded):
what kvmesh's cluster-wide store gives however many prefill nodes share it.
``reuse_by_nodes[k - 1]`` is the same with the cache split over ``k`` nodes of
``local_cache_tokens`` each (default unbounded) and no shared store: colocated nodes'
prefix caches, or a prefill node's own KV pool. Each request goes where it finishes
soonest at saturation, the node minimizing (prompt tokens it was given so far + the
tokens it would compute for this one), i.e. cache-aware routing with load balance; a hit
counts only on that node.

**Trace scaling** follows ``kvmesh.loadtest.workload.trace_items``: a hash id stands for
``block_tokens`` tokens (512 in the trace; the evaluation uses 16), input lengths scale by
``block_tokens / 512`` and are capped at ``max_input``; outputs scale by ``output_scale``
(default the same factor) and are clamped to ``[min_output, max_output]``.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake trace
DEFAULT_MAX_NODES = 8


@dataclass(frozen=True)
class RequestTokens:
    """One request as the planner sees it."""

    input_tokens: int
    """Prompt tokens."""
    output_tokens: int
    """Tokens generated (the request's max tokens)."""
    hits_shared: int
    """Prompt tokens the shared cache (the store) serves."""
    hits_by_nodes: tuple[int, ...]
    """``[k - 1]``: prompt tokens served with the cache split over ``k`` nodes."""

    def hits(self, nodes: int, shared_store: bool) -> int:
        """Hit tokens with the shared cache (``shared_store``) or split over ``nodes``."""
        if shared_store:
            return self.hits_shared
        return self.hits_by_nodes[min(max(1, nodes), len(self.hits_by_nodes)) - 1]


@dataclass(frozen=True)
class WorkloadStats:
    """Token statistics of a workload (see the module docstring)."""

    requests: int
    """Requests in the workload."""
    block_size: int
    """Tokens per cache block the reuse is counted in."""
    input_mean: float
    """Mean prompt tokens per request."""
    output_mean: float
    """Mean output tokens per request."""
    reuse: float
    """Share of prompt tokens the cache shared by every node (the store) serves."""
    reuse_by_nodes: tuple[float, ...]
    """``[k - 1]``: the share with the cache split over ``k`` nodes, no shared store."""
    shared_cache_tokens: int | None
    """Size of the shared cache in tokens (None: unbounded)."""
    local_cache_tokens: int | None
    """Size of each node's own cache in tokens when split (None: unbounded)."""
    decode_context_mean: float
    """Context tokens of a sequence in a decode batch, time-weighted (a request stays for
    its output tokens): sum(O * (I + O / 2)) / sum(O)."""
    decode_kv_mean: float
    """KV tokens a sequence in a decode batch holds, time-weighted, counting its whole
    output (the pool reserves it): sum(O * (I + O)) / sum(O)."""
    arrival_cv2: float
    """Squared coefficient of variation of the inter-arrival times (1 = Poisson; bursts
    make it larger). 1 where the workload has no arrival times."""
    samples: tuple[RequestTokens, ...]
    """The requests (evenly thinned to at most ``max_samples``), for the distribution of
    prefill times: the queueing margin depends on it."""

    def reuse_at(self, nodes: int, shared_store: bool) -> float:
        """Reuse with the shared cache, or split over ``nodes`` without a store."""
        if shared_store:
            return self.reuse
        return self.reuse_by_nodes[min(max(1, nodes), len(self.reuse_by_nodes)) - 1]

    def summary(self) -> dict[str, Any]:
        """Everything but the samples, for a report or JSON."""
        return {
            "requests": self.requests,
            "block_size": self.block_size,
            "input_mean": round(self.input_mean, 2),
            "output_mean": round(self.output_mean, 2),
            "reuse": round(self.reuse, 4),
            "reuse_by_nodes": [round(r, 4) for r in self.reuse_by_nodes],
            "shared_cache_tokens": self.shared_cache_tokens,
            "local_cache_tokens": self.local_cache_tokens,
            "decode_context_mean": round(self.decode_context_mean, 2),
            "decode_kv_mean": round(self.decode_kv_mean, 2),
            "arrival_cv2": round(self.arrival_cv2, 3),
        }

    # -- constructors -----------------------------------------------------------------------
    @classmethod
    def from_chains(
        cls,
        requests: Sequence[tuple[int, int, Sequence[Hashable]]],
        *,
        block_size: int,
        arrivals: Sequence[float] | None = None,
        max_nodes: int = DEFAULT_MAX_NODES,
        max_samples: int = 4000,
        shared_cache_tokens: int | None = None,
        local_cache_tokens: int | None = None,
    ) -> WorkloadStats:
        """The general form: ``(input_tokens, output_tokens, block keys)`` per request in
        arrival order, a key per whole ``block_size``-token block of its prompt (keys
        beyond the prompt's whole blocks are ignored); ``arrivals`` in any time unit. The
        cache sizes (tokens, None: unbounded) are the module docstring's; every other
        constructor passes them on as keywords."""
        if not requests:
            raise ValueError("a workload needs at least one request")
        if block_size < 1 or max_nodes < 1:
            raise ValueError("block_size and max_nodes must be >= 1")
        local = None if local_cache_tokens is None else local_cache_tokens // block_size
        shared = None if shared_cache_tokens is None else shared_cache_tokens // block_size
        hits = [_hits_split(requests, block_size, k, local) for k in range(1, max_nodes + 1)]
        hits_shared = _hits_split(requests, block_size, 1, shared)
        ins = [max(1, int(r[0])) for r in requests]
        outs = [max(1, int(r[1])) for r in requests]
        total_in, total_out = sum(ins), sum(outs)
        rows = [
            RequestTokens(i, o, hits_shared[j], tuple(h[j] for h in hits))
            for j, (i, o) in enumerate(zip(ins, outs))
        ]
        step = max(1, -(-len(rows) // max_samples))
        return cls(
            requests=len(rows),
            block_size=block_size,
            input_mean=total_in / len(rows),
            output_mean=total_out / len(rows),
            reuse=sum(hits_shared) / total_in,
            reuse_by_nodes=tuple(sum(h) / total_in for h in hits),
            shared_cache_tokens=shared_cache_tokens,
            local_cache_tokens=local_cache_tokens,
            decode_context_mean=sum(o * (i + o / 2) for i, o in zip(ins, outs)) / total_out,
            decode_kv_mean=sum(o * (i + o) for i, o in zip(ins, outs)) / total_out,
            arrival_cv2=_cv2_of_gaps(arrivals),
            samples=tuple(rows[::step]),
        )

    @classmethod
    def from_items(
        cls,
        items: Iterable[Sequence[Any]],
        *,
        block_size: int = 16,
        **kwargs: Any,
    ) -> WorkloadStats:
        """From ``(prompt_tokens, output_tokens, shared_prefix_tokens[, group])`` in
        arrival order: the first ``shared_prefix_tokens`` of a prompt are the prefix of
        ``group`` (default: one group for all items, e.g. a common system prompt), the rest
        its own. A group's first request computes the prefix; later ones hit the part
        that earlier ones (on the same node, when split) computed. No arrival times:
        ``arrival_cv2`` is 1 (Poisson). Other keywords: :meth:`from_chains`."""
        chains = []
        for idx, it in enumerate(items):
            n, out, shared = int(it[0]), int(it[1]), int(it[2])
            group = it[3] if len(it) > 3 else 0
            if not 0 <= shared <= n:
                raise ValueError(f"item {idx}: shared_prefix_tokens {shared} not in [0, {n}]")
            keys: list[Hashable] = [
                ("shared", group, b) if (b + 1) * block_size <= shared else ("own", idx, b)
                for b in range(n // block_size)
            ]
            chains.append((n, out, keys))
        return cls.from_chains(chains, block_size=block_size, **kwargs)

    @classmethod
    def from_workload_items(
        cls, items: Iterable[Any], *, block_size: int = 16, **kwargs: Any
    ) -> WorkloadStats:
        """From the load generator's items (``kvmesh.loadtest.workload.Item``: ``t_ms``,
        ``token_ids``, ``max_tokens``), keyed by their real token ids: the statistics of
        exactly what a run sends. Other keywords: :meth:`from_chains`."""
        its = sorted(items, key=lambda i: i.t_ms)
        chains = []
        for it in its:
            toks = list(it.token_ids)
            keys: list[Hashable] = []
            prev: Hashable = None
            for b in range(len(toks) // block_size):
                prev = hash((prev, tuple(toks[b * block_size : (b + 1) * block_size])))
                keys.append(prev)
            chains.append((len(toks), int(it.max_tokens), keys))
        arrivals = [float(i.t_ms) for i in its]
        return cls.from_chains(chains, block_size=block_size, arrivals=arrivals, **kwargs)

    @classmethod
    def from_records(
        cls,
        records: Iterable[dict],
        *,
        block_size: int = 16,
        block_tokens: int = TRACE_BLOCK,
        max_input: int | None = None,
        min_output: int = 1,
        max_output: int | None = None,
        output_scale: float | None = None,
        max_requests: int | None = None,
        **kwargs: Any,
    ) -> WorkloadStats:
        """From Mooncake trace records, scaled as ``trace_items`` scales them (see the
        module docstring); ``None`` caps mean no cap. Other keywords: :meth:`from_chains`."""
        scale = block_tokens / TRACE_BLOCK
        oscale = scale if output_scale is None else output_scale
        recs = sorted(records, key=lambda r: r["timestamp"])
        if max_requests is not None:
            recs = recs[:max_requests]
        chains = []
        for idx, r in enumerate(recs):
            n = max(1, round(r["input_length"] * scale))
            if max_input is not None:
                n = min(n, max_input)
            out = round(r["output_length"] * oscale)
            if max_output is not None:
                out = min(out, max_output)
            out = max(min_output, out)
            ids = list(r.get("hash_ids") or [])
            keys: list[Hashable] = []
            for b in range(n // block_size):
                last = (b + 1) * block_size - 1  # the block's last token ...
                j = last // block_tokens  # ... lies in the trace block of id j
                keys.append((ids[j], last % block_tokens) if j < len(ids) else ("pad", idx, b))
            chains.append((n, out, keys))
        return cls.from_chains(
            chains,
            block_size=block_size,
            arrivals=[float(r["timestamp"]) for r in recs],
            **kwargs,
        )

    @classmethod
    def from_trace(
        cls,
        path: str | Path,
        *,
        share: float | None = None,
        sample_seed: int = 0,
        **kwargs: Any,
    ) -> WorkloadStats:
        """From a Mooncake-format JSONL file; ``share`` keeps whole prefix groups with
        that probability each, as ``kvmesh.loadtest.workload.sample_groups`` does (the
        evaluation's sample of the trace). Other keywords: :meth:`from_records`."""
        with open(path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        if share is not None:
            recs = [r for r in recs if _group_kept(r, share, sample_seed)]
        return cls.from_records(recs, **kwargs)


def _group_kept(r: dict, share: float, seed: int) -> bool:
    """``sample_groups``' rule: a record is kept with its prefix group (first hash id)."""
    ids = r.get("hash_ids") or [-1]
    return random.Random(f"group-{seed}-{ids[0]}").random() < share


def _hits_split(
    requests: Sequence[tuple[int, int, Sequence[Hashable]]],
    block_size: int,
    nodes: int,
    capacity_blocks: int | None,
) -> list[int]:
    """Hit tokens of each request, in order, with the cache split over ``nodes`` nodes of
    ``capacity_blocks`` each (LRU; None: unbounded) and each request routed where it
    finishes soonest at saturation (module docstring)."""
    caches: list[OrderedDict[Hashable, None]] = [OrderedDict() for _ in range(nodes)]
    load = [0] * nodes
    out = []
    for n, _, keys in requests:
        full = list(keys[: max(0, n) // block_size])
        usable = max(0, n - 1) // block_size  # the last token is always computed
        best, best_cost, best_hit = 0, None, 0
        for k in range(nodes):
            hit = 0
            while hit < usable and full[hit] in caches[k]:
                hit += 1
            cost = load[k] + n - hit * block_size
            if best_cost is None or cost < best_cost:
                best, best_cost, best_hit = k, cost, hit
        load[best] += n - best_hit * block_size
        cache = caches[best]
        for key in full:  # the request's blocks, most recently used last
            cache[key] = None
            cache.move_to_end(key)
        if capacity_blocks is not None:
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
        out.append(best_hit * block_size)
    return out


def _cv2_of_gaps(arrivals: Sequence[float] | None) -> float:
    if arrivals is None or len(arrivals) < 3:
        return 1.0
    ts = sorted(arrivals)
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    mean = sum(gaps) / len(gaps)
    if mean <= 0:
        return 1.0
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    return var / mean**2
