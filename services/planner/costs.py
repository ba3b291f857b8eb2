"""What one model node costs, measured once: the planner's hardware input.

A :class:`NodeCosts` holds, for one model, dtype and block size at one CPU budget
(``cpus`` cores per node), the fitted cost models the planner combines with a workload:

- prefill of ``n`` new tokens on top of ``s`` cached ones (causal attention reads the
  cached prefix and the new tokens before each one, so a new token at context ``x`` costs
  ``p0 + p1 * x`` and the pass sums that over the new tokens)::

      prefill_seconds(n, s) = f + n * (p0 + p1 * (s + n / 2))

- one decode step of ``B`` sequences holding ``C`` context tokens in all::

      step_seconds(B, C) = a + b * B + c * C

- ``kv_bytes_per_token`` (all layers, K and V), the transfer engine's bandwidth in bytes/s
  and the KV pool's size in tokens.

:func:`kvmesh.services.planner.measure.measure_costs`
measures them with the real engine; :meth:`NodeCosts.save` / :meth:`NodeCosts.load` keep
them as JSON so that a plan (or the evaluation) can reuse one measurement.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class NodeCosts:
    """A model node's measured costs at a CPU budget of ``cpus`` cores."""

    model: str
    """Model the costs are for (a preset name, a shipped model or a checkpoint)."""
    dtype: str
    """Weights' and KV's dtype ("float32" or "bfloat16")."""
    block_size: int
    """Tokens per KV block (engine block = store block = prefix-cache granule)."""
    cpus: float
    """CPU budget (cores) of one node these costs hold at."""
    prefill_fixed_s: float
    """``f``: seconds of one prefill pass beyond its tokens (embedding, logits, calls)."""
    prefill_s_per_token: float
    """``p0``: seconds per new prompt token at zero context."""
    prefill_s_per_token_ctx: float
    """``p1``: extra seconds per new token per token of context before it (attention)."""
    decode_step_s: float
    """``a``: seconds of a decode step beyond its sequences (weights read once per step)."""
    decode_step_s_per_seq: float
    """``b``: seconds per sequence in the step's batch (projections, MLP, sampling)."""
    decode_step_s_per_ctx_token: float
    """``c``: seconds per context token of the batch (attention reads every cached key)."""
    kv_bytes_per_token: int
    """Bytes of KV of one token, all layers, K and V."""
    transfer_bytes_per_s: float
    """The transfer engine's bandwidth between two nodes, bytes/s (at this budget)."""
    pool_tokens: int
    """Tokens the KV pool of one node holds (its blocks x ``block_size``)."""
    transfer_on_cpu: bool = True
    """True when moving KV uses the nodes' own CPU budget (TCP copies, both sides): the
    planner then counts each transfer's time as busy time of the sending and the
    receiving node. False for RDMA, where the NIC moves the bytes."""
    threads: int = 1
    """Torch threads the node runs (ceil of its budget)."""
    raw: dict[str, Any] = field(default_factory=dict, compare=False)
    """What was measured before fitting (points, medians, the scale applied): for the
    record, never read by the planner."""

    # -- the cost models --------------------------------------------------------------------
    def prefill_seconds(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """Seconds to prefill ``new_tokens`` on top of ``cached_tokens`` already in the
        pool: ``f + n * (p0 + p1 * (s + n / 2))``; 0 for no new token."""
        if new_tokens <= 0:
            return 0.0
        ctx = cached_tokens + new_tokens / 2.0
        per_token = self.prefill_s_per_token + self.prefill_s_per_token_ctx * ctx
        return self.prefill_fixed_s + new_tokens * per_token

    def step_seconds(self, batch: float, context_tokens: float) -> float:
        """Seconds of one decode step of ``batch`` sequences holding ``context_tokens`` in
        all: ``a + b * batch + c * context_tokens``."""
        return (
            self.decode_step_s
            + self.decode_step_s_per_seq * batch
            + self.decode_step_s_per_ctx_token * context_tokens
        )

    def transfer_seconds(self, tokens: float) -> float:
        """Seconds to move the KV of ``tokens`` tokens between two nodes."""
        if tokens <= 0:
            return 0.0
        return tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def at_budget(self, cpus: float) -> NodeCosts:
        """The same costs at a budget of ``cpus`` cores, assuming the node's work scales
        linearly with its CPU time: every time x ``self.cpus / cpus``, the bandwidth /
        that (when transfers use the CPU). An approximation: a budget above the node's
        threads does not make it faster, and parallel speed-up is rarely perfect, so
        measure at the budget you plan for when you can."""
        if cpus <= 0:
            raise ValueError(f"cpus must be > 0, got {cpus}")
        k = self.cpus / cpus
        if k == 1.0:
            return self
        return dataclasses.replace(
            self,
            cpus=cpus,
            prefill_fixed_s=self.prefill_fixed_s * k,
            prefill_s_per_token=self.prefill_s_per_token * k,
            prefill_s_per_token_ctx=self.prefill_s_per_token_ctx * k,
            decode_step_s=self.decode_step_s * k,
            decode_step_s_per_seq=self.decode_step_s_per_seq * k,
            decode_step_s_per_ctx_token=self.decode_step_s_per_ctx_token * k,
            transfer_bytes_per_s=(
                self.transfer_bytes_per_s / k if self.transfer_on_cpu else self.transfer_bytes_per_s
            ),
        )

    def describe(self) -> str:
        """One line for a report: the fitted costs in readable units."""
        return (
            f"{self.model} {self.dtype} at {self.cpus:g} cores: prefill "
            f"{self.prefill_s_per_token * 1e3:.3g} ms/token"
            f" + {self.prefill_s_per_token_ctx * 1e6:.3g} us/token per context token"
            f" + {self.prefill_fixed_s * 1e3:.3g} ms/pass; decode step "
            f"{self.decode_step_s * 1e3:.3g} ms + {self.decode_step_s_per_seq * 1e3:.3g} ms/seq"
            f" + {self.decode_step_s_per_ctx_token * 1e6:.3g} us/context token; "
            f"KV {self.kv_bytes_per_token} B/token; transfer "
            f"{self.transfer_bytes_per_s / 1e6:.4g} MB/s; pool {self.pool_tokens} tokens"
        )

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeCosts:
        """Costs from :meth:`to_dict`'s form. Keys this version does not know are
        ignored (a later version's extras); a missing required one is an error naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in d
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ValueError(f"costs: missing {', '.join(missing)}")
        costs = cls(**{k: v for k, v in d.items() if k in names})
        costs.check()
        return costs

    def check(self) -> None:
        """Raises ValueError when a cost cannot describe a node (negative or zero where
        the planner divides by it)."""
        if self.cpus <= 0 or self.block_size <= 0:
            raise ValueError("costs: cpus and block_size must be > 0")
        if self.kv_bytes_per_token <= 0 or self.transfer_bytes_per_s <= 0:
            raise ValueError("costs: kv_bytes_per_token and transfer_bytes_per_s must be > 0")
        if self.pool_tokens <= 0:
            raise ValueError("costs: pool_tokens must be > 0")
        times = (
            self.prefill_fixed_s,
            self.prefill_s_per_token,
            self.prefill_s_per_token_ctx,
            self.decode_step_s,
            self.decode_step_s_per_seq,
            self.decode_step_s_per_ctx_token,
        )
        if min(times) < 0:
            raise ValueError("costs: no time coefficient may be negative")
        if self.prefill_seconds(1) <= 0 or self.step_seconds(1, 1) <= 0:
            raise ValueError("costs: a prefill and a decode step must take some time")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> NodeCosts:
        return cls.from_dict(json.loads(Path(path).read_text()))
