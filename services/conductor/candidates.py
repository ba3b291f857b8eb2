"""A request as admission sees it, its candidate routes and the decision: the estimate
of one candidate on a prefill node (``disagg_candidate``), the candidates put in TTFT
order (``sort_by_ttft``) and the decode node scan at the moment a request joins the
batch (``decode_scan``), the arithmetic of every decision (``policy.Scheduler``; typed
where compiled, candidates.pxd)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from kvmesh.services.conductor import _sorted
from kvmesh.services.conductor.nodes import DecodeNodeState, PrefillNodeState

DISAGG, COLOCATED, DIRECT = "disaggregated", "colocated", "decode-direct"
_TTFT = attrgetter("ttft_ms")


@dataclass
class Request:
    """What admission needs to know about a request."""

    request_id: str
    n_tokens: int
    hashes: list[bytes]
    max_tokens: int
    ttft_slo_ms: float  # what is left of the TTFT SLO when admission starts
    tbt_slo_ms: float
    ttft_spent_ms: float = 0.0  # of the SLO, spent in the conductor before admission


@dataclass
class Candidate:
    """One estimated way to serve a request."""

    route: str
    node: str  # the node that computes the prompt
    ttft_ms: float
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    fetch_ms: float = 0.0
    handoff_ms: float = 0.0
    cached_blocks: int = 0  # from the computing node's own pool
    fetch_blocks: int = 0  # pulled from the store
    work_ms: float = 0.0  # the node's time on it by its fitted model (before the rate)
    speed: float = 1.0  # the node's real ms per model ms the estimate counted on


@dataclass(init=False)  # (its own __init__: a default factory costs ~1 us compiled)
class Decision:
    accepted: bool
    route: str
    prefill_node: str | None
    decode_node: str | None
    estimate: Candidate | None
    tbt_ms: float
    candidates: list[Candidate]
    reason: str  # when rejected: ttft, tbt, kv, no-nodes, infeasible
    message: str
    retry_after_ms: float
    # accepted to wait for KV room on its decode node: for at most this long (0: it
    # reserves at once); the estimate counts the predicted wait
    kv_wait_ms: float

    def __init__(
        self,
        accepted: bool,
        route: str = DISAGG,
        prefill_node: str | None = None,
        decode_node: str | None = None,
        estimate: Candidate | None = None,
        tbt_ms: float = 0.0,
        candidates: list[Candidate] | None = None,
        reason: str = "",
        message: str = "",
        retry_after_ms: float = 0.0,
        kv_wait_ms: float = 0.0,
    ) -> None:
        self.accepted = accepted
        self.route = route
        self.prefill_node = prefill_node
        self.decode_node = decode_node
        self.estimate = estimate
        self.tbt_ms = tbt_ms
        self.candidates = candidates if candidates is not None else []
        self.reason = reason
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.kv_wait_ms = kv_wait_ms

    def booked(self) -> tuple[Candidate, str]:
        """The estimate and the decode node of an accepted decision (ValueError if it
        was rejected)."""
        if (
            not self.accepted
            or self.estimate is None
            or self.decode_node is None
            or (self.route == DISAGG and self.prefill_node is None)
        ):
            raise ValueError(f"the request was not accepted ({self.reason or 'no route'})")
        return self.estimate, self.decode_node


@dataclass
class Misses:
    """Why the candidates tried so far were turned down, for the rejection."""

    reason: str = ""  # the first of ttft and kv, overridden by tbt
    least_tbt: float | None = None  # the lowest predicted TBT over the SLO
    kv_short: bool = False  # a decode node lacked KV room for a candidate within its TTFT


def disagg_candidate(
    p: PrefillNodeState,
    n: int,
    usable: int,
    local: int,
    store_prefix: int,
    use_store: bool,
    now: float,
    dram_prefix: int | None,
    overhead_ms: float,
    ssd_bytes_per_ms: float,
) -> Candidate:
    """The disaggregated route's estimate on prefill node ``p`` (``Scheduler``'s
    ``_prefill_candidate``; typed where compiled, candidates.pxd)."""
    # (the hot path of every decision: ``PrefillModel.predict`` is inlined from the
    # fit's coefficients, term for term, and ``min``/``max`` of ints are written out)
    bs = p.block_size
    a, b, k2 = p.model.coef
    if usable < local:
        local = usable
    fetch_blocks, fetch_ms = 0, 0.0
    if use_store:
        top = usable if usable < store_prefix else store_prefix
        k = top - local
        if k > 0:
            if dram_prefix is not None:
                top = usable if usable < dram_prefix else dram_prefix
            on_ssd = k - (top - local if top > local else 0)
            fetch_ms = (
                p.store_fetch.predict_ms(k * p.block_nbytes, p.bandwidth)
                + on_ssd * p.block_nbytes / ssd_bytes_per_ms
            )
            new, cached = n - local * bs, local * bs
            new2, cached2 = n - (local + k) * bs, (local + k) * bs
            saved = (a + b * new + k2 * new * (new + cached)) - (
                a + b * new2 + k2 * new2 * (new2 + cached2)
            )
            if fetch_ms < saved:
                fetch_blocks = k
            else:
                fetch_ms = 0.0
    held = local + fetch_blocks
    cached = held * bs
    new = n - cached
    prefill_ms = a + b * new + k2 * new * (new + cached)
    new_blocks = -(-n // bs) - held
    # the prefix blocks go to the decode node while the new tokens compute; only the
    # part that outlasts the compute, and the last layer of the new blocks, add up
    bw = p.bandwidth
    over = held * p.block_nbytes / bw - prefill_ms
    handoff_ms = (over if over > 0.0 else 0.0) + new_blocks * p.layer_nbytes / bw
    # the slot time (what the node's measured rate scales) and the wait for the slot
    work = prefill_ms + fetch_ms + handoff_ms
    queue, f = p.wait(now)
    c = Candidate.__new__(Candidate)  # (compiled: no call through __init__'s arguments)
    c.route = DISAGG
    c.node = p.node_id
    c.ttft_ms = queue + work * f + overhead_ms
    c.queue_ms = queue
    c.prefill_ms = prefill_ms * f
    c.fetch_ms = fetch_ms * f
    c.handoff_ms = handoff_ms * f
    c.cached_blocks = local
    c.fetch_blocks = fetch_blocks
    c.work_ms = work
    c.speed = f
    return c


def sort_by_ttft(cands: list[Candidate]) -> None:
    """``cands.sort(key=attrgetter("ttft_ms"))``, in place: stable, by insertion (a
    handful of candidates; compiled, no key calls). With a NaN among them, the sort
    itself, so that the order stays the same."""
    n = len(cands)
    for i in range(n):
        c = cands[i]
        t = c.ttft_ms
        if t != t:
            cands.sort(key=_TTFT)
            return
    for i in range(1, n):
        c = cands[i]
        t = c.ttft_ms
        j = i
        while j > 0:
            prev = cands[j - 1]
            if not prev.ttft_ms > t:
                break
            cands[j] = prev
            j -= 1
        cands[j] = c


def decode_scan(
    options: Iterable[DecodeNodeState],
    need_blocks: int,
    at: float,
    n: int,
    tbt_limit: float,
    predict: bool,
    misses: Misses,
    hashes: Sequence[bytes],
) -> tuple[DecodeNodeState, float] | None:
    """Of ``options``, the decode node with ``need_blocks`` of KV room and the lowest
    predicted TBT within ``tbt_limit`` for a request of ``n`` prompt tokens joining at
    ``at`` (by the batch then with ``predict``, else by every request booked), and that
    TBT; None if none qualifies (why is added to ``misses``). A node short of room
    counts the blocks of the prompt's prefix (``hashes``) that a request decoding there
    holds: they are pinned, not taken. ``Scheduler``'s ``_decode_choice``; typed where
    compiled (candidates.pxd)."""
    best_tbt, best_d = float("inf"), None
    for d in options:
        room = d.kv_blocks_free - d.reserved_blocks - d.waiting_blocks
        if room < need_blocks and (
            not d.prompts or room < need_blocks - d.held_prefix(hashes, (n - 1) // d.block_size)
        ):
            misses.reason = misses.reason or "kv"
            misses.kv_short = True
            continue
        # the batch when this request joins it, at its first token (kvmesh; the
        # others judge by every request booked): those booked whose first token comes
        # earlier, less those ended by then; attending over their share of the KV
        # booked, plus this one's. (Each search is skipped where the answer is at an
        # end: all joined by then, or none ended.)
        ends = d.ends
        now_batch = len(ends)
        if predict:
            joins = d.joins
            batch = len(joins)
            if batch:
                last = joins[batch - 1]
                if last > at:
                    batch = _sorted.bisect_right(joins, at)
            if now_batch:
                first = ends[0]
                if not first > at:  # (a NaN: as the search)
                    batch -= _sorted.bisect_right(ends, at)
        else:
            batch = now_batch
        kv = d.kv_tokens * batch / now_batch if now_batch else 0
        a_, b_, k_ = d.model.coef
        # with other conductors' requests (``foreign``) and their KV
        tbt = a_ + b_ * (batch + d.foreign + 1) + k_ * (kv + d.foreign_kv + n)
        if tbt > tbt_limit:
            misses.reason = "tbt"
            if misses.least_tbt is None or tbt < misses.least_tbt:
                misses.least_tbt = tbt
        elif tbt < best_tbt:
            best_tbt, best_d = tbt, d
    return None if best_d is None else (best_d, best_tbt)
