"""The evaluation's three configurations on equal hardware, and one measured run on them.

Every configuration has exactly two *model nodes* that do work, each pinned to its own
core (``os.sched_setaffinity`` on the child at spawn, inherited by every thread it starts,
and checked again on every thread once the cluster is up), with one torch thread each:

- ``colocated``: 2 decode nodes that prefill and decode their own requests, local prefix
  cache only (no store segments), no admission control (the SLOs are set huge on the
  conductor and none are sent), chunked prefill between decode steps
  (``--step-token-budget``), i.e. the classic vLLM set-up. The conductor serves a model
  only when a prefill node of it is registered too, so one *idle* prefill node is
  registered, pinned beside decode-0; the huge SLOs keep every request off it (the routes
  column of the report shows it).
- ``disagg-nostore``: 1 prefill + 1 decode node, every prompt prefilled on the prefill
  node, no store segments; early rejection on the SLOs.
- ``kvmesh``: 1 prefill + 1 decode node, store segments (``segment_per_pool`` x the
  KV pool on each node), every route (short prompts prefilled on the decode node,
  decode-direct), early rejection.

The conductor, the store-master, etcd and the load generator are not pinned: they share
both cores with the nodes (the report says so).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass

from kvmesh.loadtest import metrics as M
from kvmesh.loadtest import workload as W
from kvmesh.loadtest.driver import KV_ROOM, Record, diff, drive, scrape
from kvmesh.services.common.config import parse_size
from kvmesh.services.launcher import LocalCluster

HUGE = "1000000000"
# colocated chunks its prompts by tokens alone (--step-token-budget), as vLLM's chunked
# prefill does. A fixed time bound per chunk (--prefill-chunk-ms, 50 ms by default in
# fd71fb0, off by default since 616bc59) halved a node's prefill rate when every prompt is
# computed there (colocated's trace capacity fell from 8.8 rps to below 1.9); the flag
# keeps the baseline at its strongest setting whatever the default. (Its requests carry
# no TBT SLO, so the decode node's SLO-cut chunks do not apply either.)
COLOCATED_CHUNKS = ["--prefill-chunk-ms", "0"]
# colocated's conductor: every prompt on its decode node, SLOs too large to refuse anything
COLOCATED_CONDUCTOR = [
    "--colocate-below-tokens", HUGE, "--direct-share", "1.0",
    "--ttft-slo-ms", HUGE, "--tbt-slo-ms", HUGE,
]  # fmt: skip
CONFIGS = ("colocated", "disagg-nostore", "kvmesh")


@dataclass
class Setup:
    """What every configuration of one evaluation shares."""

    model: str = "medium"
    dtype: str = "float32"
    block_size: int = 16
    kv_memory: str = "24MiB"  # each node's KV pool
    segment_per_pool: int = 10  # store segment of each node = this x its KV pool
    ttft_slo_ms: float = 2000.0
    tbt_slo_ms: float = 150.0
    threads: int = 1  # torch threads per node
    step_token_budget: int = 128  # decode nodes: running batch + prompt chunk per step
    colocate_below_tokens: int = 64  # kvmesh: shorter prompts prefilled on the decode node
    request_timeout_s: float = 120.0
    # equal compute by CPU budgets (loadtest.capacity): every model node its own cgroup of
    # ``cpus`` cores instead of a pinned core; the control plane one of ``control_cpus``
    cpus: float = 0.0
    control_cpus: float = 0.0

    @classmethod
    def from_args(cls, a, **kw) -> Setup:
        """The setup an evaluation's parsed command line gives; ``kw`` overrides."""
        names = ("model", "dtype", "block_size", "kv_memory", "segment_per_pool",
                 "ttft_slo_ms", "tbt_slo_ms", "step_token_budget", "colocate_below_tokens")  # fmt: skip
        return cls(**{n: getattr(a, n) for n in names}, **kw)

    def segment_memory(self) -> str:
        return f"{parse_size(self.kv_memory) * self.segment_per_pool // (1 << 20)}MiB"

    def to_json(self) -> dict:
        return {**asdict(self), "segment_memory": self.segment_memory()}


def node_cores() -> tuple[int, int]:
    """The two cores the model nodes get: the first two this process may run on (the
    same one twice on a single-core machine)."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[0], cores[1 if len(cores) > 1 else 0]


def configs(s: Setup, *, store: bool | None = None) -> dict[str, dict]:
    """The three configurations of :mod:`this module's docstring <kvmesh.loadtest.eval_cluster>`.
    ``store`` False turns kvmesh's segments off (the cache-size sweep's "without")."""
    a, b = node_cores()
    base = [
        "--model",
        s.model,
        "--dtype",
        s.dtype,
        "--block-size",
        str(s.block_size),
        "--kv-memory",
        s.kv_memory,
        "--threads",
        str(s.threads),
    ]
    slo = ["--ttft-slo-ms", str(s.ttft_slo_ms), "--tbt-slo-ms", str(s.tbt_slo_ms)]
    decode = ["--step-token-budget", str(s.step_token_budget)]
    seg = s.segment_memory() if store is not False else "0"
    return {
        "colocated": dict(
            prefill=1,
            decode=2,
            node_args=base + ["--segment-memory", "0"],
            decode_args=decode + COLOCATED_CHUNKS,
            conductor_args=COLOCATED_CONDUCTOR,
            send_slo=False,
            pin={"decode-0": a, "decode-1": b, "prefill-0": a},
            note="2 decode nodes prefill + decode their own requests (local prefix cache "
            "only, chunked prefill, no admission control); 1 idle prefill node registered",
        ),
        "disagg-nostore": dict(
            prefill=1,
            decode=1,
            node_args=base + ["--segment-memory", "0"],
            decode_args=decode,
            conductor_args=["--colocate-below-tokens", "0", "--direct-share", "1.0", *slo],
            send_slo=True,
            pin={"prefill-0": a, "decode-0": b},
            note="1 prefill + 1 decode, no store, every prompt on the prefill node, "
            "early rejection",
        ),
        "kvmesh": dict(
            prefill=1,
            decode=1,
            node_args=base + ["--segment-memory", seg],
            decode_args=decode,
            conductor_args=["--colocate-below-tokens", str(s.colocate_below_tokens), *slo],
            send_slo=True,
            pin={"prefill-0": a, "decode-0": b},
            note=f"1 prefill + 1 decode, store segments {seg} per node, every route, "
            "early rejection",
        ),
    }


def budget_configs(s: Setup, nodes: int, ratios: list[tuple[int, int]]) -> dict[str, dict]:
    """Configurations at equal node compute: ``nodes`` model nodes of ``s.cpus`` cores
    each, no pinning. ``colocated``: ``nodes`` decode nodes that prefill and decode (plus
    the idle prefill node the conductor needs, whose CPU use the report shows); for each
    (P, D) of ``ratios``: ``kvmesh-PpDd`` (store segments, every route, early rejection)
    and ``nostore-PpDd`` (every prompt on a prefill node, no store)."""
    base = [
        "--model", s.model, "--dtype", s.dtype, "--block-size", str(s.block_size),
        "--kv-memory", s.kv_memory,
    ]  # fmt: skip
    if s.threads > 0:
        base += ["--threads", str(s.threads)]
    slo = ["--ttft-slo-ms", str(s.ttft_slo_ms), "--tbt-slo-ms", str(s.tbt_slo_ms)]
    decode = ["--step-token-budget", str(s.step_token_budget)]
    out = {
        "colocated": dict(
            prefill=1,
            decode=nodes,
            node_args=base + ["--segment-memory", "0"],
            decode_args=decode + COLOCATED_CHUNKS,
            conductor_args=COLOCATED_CONDUCTOR,
            send_slo=False,
            pin={},
            working=[f"decode-{i}" for i in range(nodes)],
            note=f"{nodes} decode nodes of {s.cpus:g} cores prefill + decode their own "
            "requests (local prefix cache only, chunked prefill, no admission control); "
            "1 idle prefill node registered",
        )
    }
    for p, d in ratios:
        if p < 1 or d < 1 or p + d != nodes:
            raise ValueError(f"ratio {p}:{d}: both >= 1 and summing to {nodes}")
        working = [f"prefill-{i}" for i in range(p)] + [f"decode-{i}" for i in range(d)]
        out[f"kvmesh-{p}p{d}d"] = dict(
            prefill=p,
            decode=d,
            node_args=base + ["--segment-memory", s.segment_memory()],
            decode_args=decode,
            conductor_args=["--colocate-below-tokens", str(s.colocate_below_tokens), *slo],
            send_slo=True,
            pin={},
            working=working,
            note=f"{p} prefill + {d} decode of {s.cpus:g} cores, store segments "
            f"{s.segment_memory()} per node, every route, early rejection",
        )
        out[f"nostore-{p}p{d}d"] = dict(
            prefill=p,
            decode=d,
            node_args=base + ["--segment-memory", "0"],
            decode_args=decode,
            conductor_args=["--colocate-below-tokens", "0", "--direct-share", "1.0", *slo],
            send_slo=True,
            pin={},
            working=working,
            note=f"{p} prefill + {d} decode of {s.cpus:g} cores, no store, every prompt "
            "on a prefill node, early rejection",
        )
    return out


def pin_tree(pid: int, core: int) -> int:
    """Pins every thread of process ``pid`` to ``core``; returns how many were pinned."""
    n = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = [str(pid)]
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), {core})
            n += 1
        except OSError:  # a thread that just ended
            pass
    return n


def affinity_of(pid: int) -> set[int]:
    """The union of the cores the threads of ``pid`` may run on."""
    out: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out |= os.sched_getaffinity(int(tid))
        except OSError:
            pass
    return out


class PinnedCluster(LocalCluster):
    """A LocalCluster whose named services are pinned to a core from the moment they are
    spawned (before the interpreter starts a thread: every later thread inherits it)."""

    def __init__(self, *a, pin: dict[str, int], **kw) -> None:
        super().__init__(*a, **kw)
        self.pin = pin

    def spawn(self, name: str, role: str, extra: list[str]) -> subprocess.Popen:
        p = super().spawn(name, role, extra)
        if name in self.pin:
            pin_tree(p.pid, self.pin[name])
        return p

    def repin(self) -> dict[str, list[int]]:
        """Pins every thread again (none should have moved) and returns each pinned
        service's cores, as read back from /proc."""
        out = {}
        for name, core in self.pin.items():
            pid = self.procs[name].pid
            pin_tree(pid, core)
            out[name] = sorted(affinity_of(pid))
        return out


class ConfigCluster:
    """One configuration's cluster, started once and measured many times (every run
    brings its own token contents, so no run hits another's blocks; what earlier runs
    left in the pools and the store is what a long-running cluster carries: it is
    evicted as any cold block is)."""

    def __init__(self, name: str, cfg: dict, setup: Setup, log_level: str = "WARNING"):
        self.name, self.cfg, self.setup = name, cfg, setup
        self.workdir = tempfile.mkdtemp(prefix=f"kvmesh-eval-{name}-")
        self.cluster = PinnedCluster(
            self.workdir,
            prefill=cfg["prefill"],
            decode=cfg["decode"],
            node_args=cfg["node_args"],
            decode_args=cfg.get("decode_args", []),
            conductor_args=cfg["conductor_args"],
            http_port=-1,
            log_level=log_level,
            pin=cfg["pin"],
            cpus=setup.cpus,
            control_cpus=setup.control_cpus,
        )
        self.startup_s = 0.0
        self.affinity: dict[str, list[int]] = {}
        self._warm = 0

    def __enter__(self) -> ConfigCluster:
        t0 = time.monotonic()
        try:
            self.cluster.start(timeout=180)
            self.affinity = self.cluster.repin()
            self.startup_s = round(time.monotonic() - t0, 1)
            self.warmup()
        except BaseException:
            self._print_log_tails()
            self.close()
            raise
        return self

    def _print_log_tails(self, lines: int = 15) -> None:
        """The end of every service's log (the workdir is removed on close)."""
        for log in sorted(os.listdir(self.workdir)):
            if log.endswith(".log"):
                with open(os.path.join(self.workdir, log), errors="replace") as f:
                    tail = f.readlines()[-lines:]
                print(f"--- {self.name}: {log}\n{''.join(tail)}", flush=True)

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.cluster.stop()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def warmup(self) -> None:
        """Two short requests per node (their own tokens), so that no measured request
        pays a first call's set-up."""
        self._warm += 1
        items = [
            W.Item(
                f"warm-{self._warm}-{i}", 0.0, W.block_tokens(10**9 + 97 * self._warm + i, 96), 4
            )
            for i in range(4)
        ]
        asyncio.run(drive(self.cluster.conductor, items, timeout=60))

    def run(self, items: list[W.Item], *, label: str = "") -> dict:
        """Drives ``items`` open-loop and returns the run's summary (metrics.summarize),
        per-node token counts, data-plane counters and the records (token times dropped)."""
        s = self.setup
        c = self.cluster
        nodes = c.status().nodes
        addrs = [n.metrics_address for n in nodes if n.metrics_address and n.role != "conductor"]
        caddrs = [n.metrics_address for n in nodes if n.metrics_address and n.role == "conductor"]
        before = scrape(addrs)
        kv_before = scrape(caddrs, want=KV_ROOM)
        node_before = {
            n.node_id: (n.computed_tokens_total, n.cached_tokens_total, n.fetched_tokens_total)
            for n in nodes
        }
        rejected_before = c.status().requests_rejected
        cpu_before = {n.node_id: n.cpu_seconds for n in nodes}
        control_before = c.control_cpu_seconds()
        t0 = time.perf_counter()
        recs: list[Record] = asyncio.run(
            drive(
                c.conductor,
                items,
                timeout=s.request_timeout_s,
                slo=(s.ttft_slo_ms, s.tbt_slo_ms) if self.cfg.get("send_slo", True) else None,
            )
        )
        wall = time.perf_counter() - t0
        st = c.status()
        d = diff(scrape(addrs), before)
        kv = diff(scrape(caddrs, want=KV_ROOM), kv_before)
        per_node = {}
        for n in st.nodes:
            b = node_before.get(n.node_id, (0, 0, 0))
            if n.role in ("prefill", "decode"):
                per_node[n.node_id] = {
                    "role": n.role,
                    "computed": n.computed_tokens_total - b[0],
                    "cached": n.cached_tokens_total - b[1],
                    "fetched": n.fetched_tokens_total - b[2],
                }
        summary = M.summarize(recs, ttft_slo_ms=s.ttft_slo_ms, tbt_slo_ms=s.tbt_slo_ms)
        if s.cpus > 0:  # each node's CPU in this run against its budget over the run
            summary["cpu"] = {
                n.node_id: {
                    "seconds": round(n.cpu_seconds - cpu_before.get(n.node_id, 0.0), 3),
                    "budget_seconds": round(n.cpu_budget_cores * wall, 3),
                    "share_of_budget": round(
                        (n.cpu_seconds - cpu_before.get(n.node_id, 0.0))
                        / max(1e-9, n.cpu_budget_cores * wall),
                        4,
                    ),
                }
                for n in st.nodes
                if n.role in ("prefill", "decode") and n.cpu_budget_cores > 0
            }
            used = c.control_cpu_seconds()
            if used is not None and control_before is not None:
                summary["cpu"]["control-plane"] = {
                    "seconds": round(used - control_before, 3),
                    "budget_seconds": round(s.control_cpus * wall, 3),
                    "share_of_budget": round(
                        (used - control_before) / max(1e-9, s.control_cpus * wall), 4
                    ),
                }
        prompt = sum(len(i.token_ids) for i in items)
        computed = sum(v["computed"] for v in per_node.values())
        fetched = sum(v["fetched"] for v in per_node.values())
        summary["node_tokens"] = {
            "computed": computed,
            "cached_local": sum(v["cached"] for v in per_node.values()),
            "fetched_store": fetched,
            "prompt_sent": prompt,
        }
        summary["data_plane"] = {
            "bytes_moved": {
                k.split("=")[1].rstrip("}"): v
                for k, v in d.items()
                if k.startswith("kvmesh_transfer_bytes_total")
            },
        }
        summary["conductor_rejected"] = st.requests_rejected - rejected_before
        summary["kv_room"] = {
            "waits_admitted": round(kv.get("kvmesh_kv_waits_total{cause=admission}", 0.0)),
            "waits_after_refused_reserve": round(
                kv.get("kvmesh_kv_waits_total{cause=reserve_refused}", 0.0)
            ),
            "reserves_refused": round(kv.get("kvmesh_reserves_refused_total", 0.0)),
        }
        # how fast a refusal comes back (the goal: within 50 ms at p99)
        refused = [r.error_ms for r in recs if r.status == "RESOURCE_EXHAUSTED" and r.error_ms]
        summary["reject_ms"] = {
            "n": len(refused),
            "p50": M.rounded(M.quantile(refused, 0.5)),
            "p99": M.rounded(M.quantile(refused, 0.99)),
        }
        # the hand-off: a request's first token (prefill) to its second (decode)
        first = [
            r.token_times_ms[1] - r.token_times_ms[0] for r in recs if len(r.token_times_ms) > 1
        ]
        summary["first_gap_ms"] = {
            "p50": M.rounded(M.quantile(first, 0.5)),
            "p99": M.rounded(M.quantile(first, 0.99)),
            "max": M.rounded(max(first)) if first else None,
        }
        summary["tbt_mean_p99_ms"] = M.rounded(
            M.quantile(
                [x for x in (M.mean_tbt(r.to_json()) for r in recs if r.status == "OK") if x],
                0.99,
            )
        )
        return {
            "config": self.name,
            "label": label,
            "wall_s": round(wall, 1),
            "summary": summary,
            "per_node": per_node,
            "records": [
                {k: v for k, v in r.to_json().items() if k != "token_times_ms"} for r in recs
            ],
        }
