"""``kvmesh plan``: the planner on a workload file, from the command line.

    kvmesh plan --workload trace.jsonl --nodes 4 --cpus 0.375
    kvmesh plan --workload trace.jsonl --nodes 4 --cpus 0.375 --costs costs.json --json

Costs come from ``--costs FILE`` (JSON of :class:`NodeCosts`, e.g. written by
``--save-costs``), else they are measured here with the real engine (a few seconds with a
small model). Prefix reuse is counted with each node's own cache the size of its KV pool
and an unbounded store (``--local-cache-tokens``, ``--store-tokens``). The trace is read
unscaled by default; the evaluation's scaling is
``--block-tokens 16 --max-input 1536 --max-output 32 --output-scale 0.0833``.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvmesh.services.planner.costs import NodeCosts
from kvmesh.services.planner.plan import plan
from kvmesh.services.planner.workload_stats import TRACE_BLOCK, WorkloadStats


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value

    return parse


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True, help="Mooncake-format trace (JSON Lines)")
    p.add_argument("--nodes", type=_positive(int), required=True, help="model nodes in all")
    p.add_argument("--cpus", type=_positive(float), required=True, help="each node's cores")
    p.add_argument("--model", default="medium", help="preset or checkpoint (to measure)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=_positive(int), default=16, help="tokens per KV block")
    p.add_argument("--kv-memory", default="24MiB", help="each node's KV pool (to measure)")
    p.add_argument("--costs", help="measured costs (JSON): skip measuring")
    p.add_argument("--save-costs", help="write the costs used to this JSON file")
    p.add_argument("--ttft-slo-ms", type=_positive(float), default=2000.0)
    p.add_argument("--tbt-slo-ms", type=_positive(float), default=150.0)
    p.add_argument(
        "--attainment", type=float, default=0.9, help="share of requests inside both SLOs"
    )
    p.add_argument(
        "--step-token-budget",
        type=_positive(int),
        default=128,
        help="colocated nodes: batch + prompt chunk per step",
    )
    p.add_argument(
        "--block-tokens",
        type=_positive(int),
        default=TRACE_BLOCK,
        help="tokens per trace hash id (512 = unscaled; the evaluation uses 16)",
    )
    p.add_argument("--max-input", type=_positive(int), help="cap on prompt tokens")
    p.add_argument("--max-output", type=_positive(int), help="cap on output tokens")
    p.add_argument("--min-output", type=_positive(int), default=1)
    p.add_argument(
        "--output-scale", type=_positive(float), help="outputs x this (default: as inputs)"
    )
    p.add_argument("--trace-share", type=_positive(float), help="keep this share of groups")
    p.add_argument("--trace-sample", type=int, default=0, help="seed of that group sample")
    p.add_argument(
        "--local-cache-tokens",
        type=int,
        help="a node's own prefix cache, tokens (default: its KV pool; 0 = unbounded)",
    )
    p.add_argument(
        "--store-tokens",
        type=int,
        default=0,
        help="the cluster-wide store's size in tokens (default 0 = unbounded)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    """Parsed ``kvmesh plan`` arguments -> the plan on stdout; the exit status."""
    if args.nodes < 2:
        print("kvmesh plan: error: --nodes must be at least 2", file=sys.stderr)
        return 2
    try:
        if args.costs:
            costs = NodeCosts.load(args.costs)
        else:
            print(f"measuring {args.model} {args.dtype} ...", file=sys.stderr)
            from kvmesh.services.planner.measure import measure_costs

            costs = measure_costs(
                args.model,
                args.dtype,
                block_size=args.block_size,
                cpus=args.cpus,
                kv_memory=args.kv_memory,
            )
        if args.save_costs:
            costs.save(args.save_costs)
        local = costs.pool_tokens if args.local_cache_tokens is None else args.local_cache_tokens
        stats = WorkloadStats.from_trace(
            args.workload,
            share=args.trace_share,
            sample_seed=args.trace_sample,
            block_size=costs.block_size,
            block_tokens=args.block_tokens,
            max_input=args.max_input,
            min_output=args.min_output,
            max_output=args.max_output,
            output_scale=args.output_scale,
            local_cache_tokens=local or None,
            shared_cache_tokens=args.store_tokens or None,
        )
        result = plan(
            costs,
            stats,
            args.nodes,
            args.cpus,
            args.ttft_slo_ms / 1e3,
            args.tbt_slo_ms / 1e3,
            attainment=args.attainment,
            step_token_budget=args.step_token_budget,
        )
    except (OSError, ValueError, KeyError) as e:
        print(f"kvmesh plan: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.format_table())
    return 0
