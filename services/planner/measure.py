"""Measuring a :class:`~kvmesh.services.planner.costs.NodeCosts` in this process, with the
real engine (the calls a model node makes: ``forward_prefill`` on a :class:`KVPool`,
``forward_decode`` of a batch) and the real transfer engine (two engines on loopback).

Prefill passes of a few lengths, with and without a cached prefix, are fitted to
``f + n * (p0 + p1 * (s + n / 2))``; decode steps of a few batch sizes and context lengths
to ``a + b * B + c * C``, both by least squares with non-negative coefficients (medians of
``reps`` runs after a warm-up). Times are this process's CPU seconds over the cores a node
gets (see :func:`measure_costs`), so a machine shared with other work measures the same.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvmesh.services.planner.costs import NodeCosts

# (new tokens, cached tokens) of the prefill passes measured
PREFILL_POINTS = ((32, 0), (128, 0), (512, 0), (128, 512), (256, 768))
# (batch, context tokens per sequence) of the decode steps measured
DECODE_POINTS = tuple((b, x) for x in (64, 256, 1024) for b in (1, 4, 16))
TRANSFER_BYTES = 16 << 20  # moved per bandwidth repetition
_SECRET = b"planner-measure"


def fit_nonnegative(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least squares ``rows @ x ~ y`` with every ``x >= 0``: a coefficient that comes out
    negative (noise, where the true one is ~0) is held at 0 and the others refitted."""
    a = np.asarray(rows, dtype=float)
    b = np.asarray(y, dtype=float)
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return [float(v) for v in x]


def own_cpu_quota(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """Cores this process's own cgroup is held to (v2 ``cpu.max`` or v1
    ``cpu.cfs_quota_us``), or None where it has no quota (or it cannot be read)."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        path = path.lstrip("/")
        try:
            if ctrls == "":
                with open(os.path.join(root, path, "cpu.max")) as f:
                    quota, period = f.read().split()[:2]
                if quota != "max":
                    return int(quota) / int(period)
            elif "cpu" in ctrls.split(","):
                base = os.path.join(root, ctrls)
                with open(os.path.join(base, path, "cpu.cfs_quota_us")) as f:
                    q = int(f.read())
                with open(os.path.join(base, path, "cpu.cfs_period_us")) as f:
                    p = int(f.read())
                if q > 0:
                    return q / p
        except (OSError, ValueError):
            continue
    return None


def _median_time(fn: Callable[[int, int], float], point: tuple[int, int], reps: int) -> float:
    fn(*point)  # warm-up
    return statistics.median(fn(*point) for _ in range(reps))


def measure_transfer(
    block_bytes: int, cpus: float | None = None, total: int = TRANSFER_BYTES, reps: int = 3
) -> float:
    """Bytes/s of WRITEs of ``block_bytes`` slices between two transfer engines in this
    process over loopback TCP (the path a KV hand-off takes between two nodes of one
    machine), after a warm-up: ``total`` bytes over the fastest of ``reps`` batches. With
    ``cpus``, each side held to that budget: at most ``total / (CPU seconds per side /
    cpus)``, CPU seconds per side being half this process's (both engines run here)."""
    from kvmesh.rdma import Slice, TransferEngine

    async def run() -> float:
        a = TransferEngine(_SECRET, transport="tcp")
        b = TransferEngine(_SECRET, transport="tcp")
        await a.start()
        await b.start()
        try:
            src = np.random.default_rng(0).integers(0, 256, size=total, dtype=np.uint8)
            dst = np.zeros(total, dtype=np.uint8)
            rs, rd = a.register(src), b.register(dst)
            step = max(1, min(block_bytes, total))
            sl = [Slice(rs, o, rd, o, min(step, total - o)) for o in range(0, total, step)]
            await a.write(b.address, sl)  # warm-up: connections, page faults
            walls, cpu = [], []
            for _ in range(reps):
                t0, c0 = time.perf_counter(), time.process_time()
                await a.write(b.address, sl)
                walls.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            if not np.array_equal(src, dst):
                raise RuntimeError("transfer measurement: the bytes moved differ")
            rate = total / min(walls)
            if cpus is not None:
                rate = min(rate, total / (statistics.median(cpu) / 2 / cpus))
            return rate
        finally:
            await a.close()
            await b.close()

    return asyncio.run(run())


def measure_costs(
    model: str = "medium",
    dtype: str = "float32",
    block_size: int = 16,
    threads: int | None = None,
    cpus: float | None = None,
    *,
    kv_memory: str | int = "24MiB",
    budgeted: bool | None = None,
    bandwidth: float | None = None,
    transfer_on_cpu: bool = True,
    reps: int = 3,
    seed: int = 0,
) -> NodeCosts:
    """Measure a node's costs in this process and return them at a budget of ``cpus``.

    ``threads`` torch threads run the engine (default ``ceil(cpus)``, as a budgeted node
    does). ``kv_memory`` is a node's KV pool (e.g. "24MiB"): ``pool_tokens`` is what it
    holds. ``bandwidth`` (bytes/s) skips the transfer measurement; ``transfer_on_cpu``
    False says the transfers use RDMA (not the nodes' CPU).

    **Scaling.** Unless this process is itself held to the budget, every time is the
    CPU time the work took (this process's, all threads: what a CFS quota counts, and
    what other processes on a shared machine do not inflate) divided by the cores it
    gets, ``min(cpus, cores measured with)``: a node at 0.375 of a core does a CPU-second
    of work in 1 / 0.375 seconds. "Cores measured with" is ``threads``, or fewer where
    this process's CPU affinity or own cgroup quota allows fewer: more budget than
    threads does not make a node faster. The bandwidth is capped the same way (each
    side's CPU seconds over ``cpus``) when transfers use the CPU. Pass ``budgeted=True``
    when this process already runs under the budget (detected from its own cgroup quota
    when None): the times are then wall-clock times, throttling included, unscaled.
    ``cpus`` None: the costs at the cores measured with.
    """
    import torch

    from kvmesh.services.common.config import parse_size
    from kvmesh.services.engine.checkpoint import load_model
    from kvmesh.services.engine.config import dtype_name, resolve_dtype
    from kvmesh.services.engine.kv_pool import KVPool

    if cpus is not None and cpus <= 0:
        raise ValueError(f"cpus must be > 0, got {cpus}")
    if threads is None:
        threads = max(1, math.ceil((cpus or 1.0) - 1e-9))
    quota = own_cpu_quota()
    used = float(min(threads, len(os.sched_getaffinity(0)), quota or math.inf))
    if budgeted is None:
        budgeted = cpus is not None and quota is not None and quota <= cpus * 1.05
    budget = used if cpus is None else cpus
    divisor = 1.0 if budgeted else min(budget, used)  # times = clock seconds / divisor
    clock = time.perf_counter if budgeted else time.process_time

    dt = resolve_dtype(dtype)
    m = load_model(model, dtype=dt, seed=seed).model
    c = m.config
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    # a model of few positions (demo: 1024) is measured at points scaled into them
    fit = min(1.0, (c.max_position_embeddings - 2) / max(n + s for n, s in PREFILL_POINTS))
    prefill_points = [(max(1, int(n * fit)), int(s * fit)) for n, s in PREFILL_POINTS]
    fit = min(1.0, (c.max_position_embeddings - 2) / max(x for _, x in DECODE_POINTS))
    decode_points = [(b, max(1, int(x * fit))) for b, x in DECODE_POINTS]
    try:
        longest = max(n + s for n, s in prefill_points)
        most = max(b * (ctx + 2) for b, ctx in decode_points)
        pool = KVPool(c, (max(longest, most) // block_size) * 2 + 64, block_size, dtype=dt)
        g = torch.Generator().manual_seed(seed)

        def prefill(n: int, s: int) -> float:
            table = pool.allocate(-(-(n + s) // block_size))
            try:
                if s:
                    m.forward_prefill(
                        torch.randint(0, c.vocab_size, (s,), generator=g), 0, pool, table
                    )
                toks = torch.randint(0, c.vocab_size, (n,), generator=g)
                t0 = clock()
                m.forward_prefill(toks, s, pool, table)
                return (clock() - t0) / divisor
            finally:
                pool.free(table)

        def step(batch: int, ctx: int) -> float:
            tables = [pool.allocate(ctx // block_size + 1) for _ in range(batch)]
            try:
                toks = torch.randint(0, c.vocab_size, (batch,), generator=g)
                t0 = clock()
                m.forward_decode(toks, [ctx] * batch, tables, pool)
                return (clock() - t0) / divisor
            finally:
                for t in tables:
                    pool.free(t)

        pf = [_median_time(prefill, point, reps) for point in prefill_points]
        ds = [_median_time(step, point, reps) for point in decode_points]
        block_bytes = pool.block_nbytes
    finally:
        torch.set_num_threads(old_threads)
    f, p0, p1 = fit_nonnegative([(1.0, n, n * (s + n / 2)) for n, s in prefill_points], pf)
    a, b, cc = fit_nonnegative([(1.0, bb, bb * x) for bb, x in decode_points], ds)
    kv = c.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.finfo(dt).bits // 8
    if bandwidth is None:
        held = None if budgeted or not transfer_on_cpu else budget
        bw = measure_transfer(block_bytes, held)
    else:
        bw = bandwidth
    pool_blocks = parse_size(kv_memory) // KVPool.block_bytes(c, block_size, dt)
    raw: dict[str, Any] = {
        "prefill_points": [[n, s, t] for (n, s), t in zip(prefill_points, pf)],
        "decode_points": [[bb, x, t] for (bb, x), t in zip(decode_points, ds)],
        "measured_cores": used,
        "clock": "wall" if budgeted else "cpu",
        "divisor": divisor,
        "budgeted": budgeted,
        "bandwidth_measured": bandwidth is None,
        "kv_memory": kv_memory,
    }
    return NodeCosts(
        model=model,
        dtype=dtype_name(dt),
        block_size=block_size,
        cpus=budget,
        prefill_fixed_s=f,
        prefill_s_per_token=p0,
        prefill_s_per_token_ctx=p1,
        decode_step_s=a,
        decode_step_s_per_seq=b,
        decode_step_s_per_ctx_token=cc,
        kv_bytes_per_token=int(kv),
        transfer_bytes_per_s=float(bw),
        pool_tokens=int(pool_blocks * block_size),
        transfer_on_cpu=transfer_on_cpu,
        threads=threads,
        raw=raw,
    )
