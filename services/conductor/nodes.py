"""The conductor's view of each node, what its estimates read: a prefill node's time
models and FIFO queue (``PrefillNodeState``), a decode node's booked requests, their
join and end times, and its KV (``DecodeNodeState``), each kept up by the scheduler's
bookings and the node's load reports. Typed where compiled (nodes.pxd)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.services.conductor import _sorted
from kvmesh.services.conductor.estimator import DecodeModel, MeasuredRate, PrefillModel
from kvmesh.services.conductor.store_fetch import StoreFetchModel


class PrefillNodeState:
    """A prefill node as the conductor sees it: its time models and its queue.

    - ``queue``: FIFO, as the node serves it: request -> its slot time in model ms
      (prefill, fetch and handoff, as predicted by ``model``; ``rate.factor`` turns it
      into real ms);
    - ``queue_ms``: model ms of everything queued (ours + ``foreign_ms``); setting it
      tells the least-queued orders holding this node (queue_order.py) that it moved;
    - ``store_fetch``: the store's remote path as this node's fetches measured it (not
      the engine's bandwidth); ``bandwidth``: bytes per ms (1 GB/s until measured);
    - ``head_since``: when the head of the queue started computing; ``rate``: real /
      model slot time; ``lag_ms``: from booking to the node starting a request of an
      empty queue;
    - ``foreign``/``foreign_ms``: other conductors' work on the node, the requests its
      load report counts beyond ours (see ``report_queue``), at the node's observed time
      per prefill.

    (A plain class, not a dataclass: compiled (nodes.pxd) it is an extension type with
    typed attributes, and ``queue_ms`` is a property of its own.)"""

    def __init__(
        self,
        node_id: str,
        block_size: int,
        block_nbytes: int,
        layer_nbytes: int,
        model: PrefillModel | None = None,
        bandwidth: float = 1e6,
        store_fetch: StoreFetchModel | None = None,
        queue: dict[str, float] | None = None,
        queue_ms: float = 0.0,
        head_since: float = 0.0,
        rate: MeasuredRate | None = None,
        lag_ms: float = 0.0,
        foreign: int = 0,
        foreign_ms: float = 0.0,
    ) -> None:
        self._orders: tuple[Any, ...] = ()  # the least-queued orders holding this node
        self.node_id = node_id
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self.layer_nbytes = layer_nbytes
        self.model = model if model is not None else PrefillModel()
        self.bandwidth = bandwidth
        self.store_fetch = store_fetch if store_fetch is not None else StoreFetchModel()
        self.queue = queue if queue is not None else {}
        self._queue_ms = 0.0
        self.queue_ms = queue_ms
        self.head_since = head_since
        self.rate = rate if rate is not None else MeasuredRate()
        self.lag_ms = lag_ms
        self.foreign = foreign
        self.foreign_ms = foreign_ms

    def __repr__(self) -> str:
        return (
            f"PrefillNodeState(node_id={self.node_id!r}, queued={len(self.queue)}, "
            f"queue_ms={self._queue_ms!r}, foreign={self.foreign!r})"
        )

    @property
    def queue_ms(self) -> float:
        return self._queue_ms

    @queue_ms.setter
    def queue_ms(self, ms: float) -> None:
        self._set_queue_ms(ms)

    def _set_queue_ms(self, ms: float) -> None:
        self._queue_ms = ms
        for order in self._orders:  # the schedulers' least-queued orders holding this node
            order.moved(self)

    def enqueue(self, rid: str, ms: float, now: float = 0.0) -> None:
        if not self.queue:
            self.head_since = now + self.lag_ms
        self.queue[rid] = ms
        self._set_queue_ms(self._queue_ms + ms)

    def dequeue(self, rid: str, now: float = 0.0) -> None:
        queue = self.queue
        if rid not in queue:
            return
        head = None
        for head in queue:  # noqa: B007 (the first key; compiled: no iterator object)
            break
        was_head = head == rid
        left = self._queue_ms - queue.pop(rid)
        self._set_queue_ms(left if left > 0.0 else 0.0)  # max(0.0, left)
        if was_head:
            self.head_since = now

    def speed(self, now: float) -> float:
        """Real ms per model ms now: the measured rate, or slower while the head of the
        queue has already run past its prediction at that rate (the node is slower right
        now than its recent prefills said)."""
        f = self.rate.factor(self.model)
        if self.queue:
            head = next(iter(self.queue.values()))
            if head > 0:
                f = max(f, (now - self.head_since) / head)
        return f

    def remaining(self, now: float) -> float:
        """Real ms until everything queued has left the slot, the wait of a request booked
        now (FIFO: it waits for all of it): the queued model ms at the node's speed, less
        the part of the head's slot time already served (in-flight credit)."""
        return self.wait(now)[0]

    def wait(self, now: float) -> tuple[float, float]:
        """``(remaining(now), speed(now))``, computed together (the estimate of every
        candidate needs both)."""
        f = self.rate.factor(self.model)
        queue = self.queue
        if not queue:
            return self.foreign_ms, f
        head = 0.0
        for head in queue.values():  # noqa: B007 (the first; compiled: no iterator object)
            break
        since = now - self.head_since
        if head > 0:
            late = since / head
            if late > f:  # max(f, late), written out (a decision's hot path)
                f = late
        done = head * f
        served = since if since > 0.0 else 0.0  # max(0.0, since)
        if served < done:  # min(done, served)
            done = served
        foreign = self.foreign_ms
        return (self._queue_ms - foreign) * f + foreign - done, f

    def report_queue(self, reported: int, per_request_ms: float) -> None:
        """The node's load report: ``reported`` requests queued or computing there, from
        every conductor. Ours are those in ``queue`` (some of which may not have reached
        the node yet, or have left it), so the node holds at least ``reported -
        len(queue)`` of other conductors': counted at ``per_request_ms`` each, never one
        of ours twice."""
        self.foreign = max(0, reported - len(self.queue))
        self.foreign_ms = self.foreign * per_request_ms
        self.queue_ms = sum(self.queue.values()) + self.foreign_ms


@dataclass
class DecodeNodeState:
    node_id: str
    block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    model: DecodeModel = field(default_factory=DecodeModel)
    prefill_model: PrefillModel = field(default_factory=PrefillModel)
    bandwidth: float = 1e6
    ends: list[float] = field(default_factory=list)  # predicted end times, sorted
    # when each booked request joins the batch (its first token out), sorted, and by id
    joins: list[float] = field(default_factory=list)
    join_of: dict[str, float] = field(default_factory=dict)
    work: dict[str, tuple[float, int, int]] = field(
        default_factory=dict
    )  # rid -> (end, kv, blocks)
    kv_tokens: int = 0
    reserved_blocks: int = 0  # reserved by us and not yet in a report
    unreported: set[str] = field(default_factory=set)  # requests counted in reserved_blocks
    # of those, the ones the node has reserved: rid -> the reservation's number there
    # (its Reserve answer's reserve_seq; the node's numbers only rise); a report counts
    # it once its reserves_seen reaches that. ``reports_seen``: the last report's (0:
    # the node does not number its reservations)
    reserve_seq: dict[str, int] = field(default_factory=dict)
    reports_seen: int = 0
    local_queue_ms: float = 0.0  # colocated prefills queued here
    local_booked: dict[str, float] = field(default_factory=dict)  # rid -> its share of it
    # other conductors' requests on the node (reserved or decoding) beyond ours, from its
    # load report (see report_queue), and their KV tokens
    foreign: int = 0
    foreign_kv: int = 0
    prefill_rate: MeasuredRate = field(default_factory=MeasuredRate)  # colocated prefills
    # rid -> the prompt's block hashes, of booked requests whose prompt KV is in place
    # here (cached and pinned by them: a request sharing the prefix pins it, no copy)
    prompts: dict[str, Sequence[bytes]] = field(default_factory=dict)
    # admitted to wait for KV room here (not reserved on the node yet): rid -> blocks,
    # and their sum, which load reports do not reset (the node does not hold them)
    waiting: dict[str, int] = field(default_factory=dict)
    waiting_blocks: int = 0

    def report_queue(self, reported: int, kv_used_tokens: int) -> None:
        """The node's load report: ``reported`` requests reserved or decoding there, from
        every conductor, holding ``kv_used_tokens``. Ours are those in ``work``, so the
        node holds at least ``reported - len(work)`` of other conductors' requests; they
        hold the used KV beyond ours (never one of ours counted twice)."""
        waiting = self.waiting  # (admitted here, not on the node yet)
        ours = len(self.work) - len(waiting)
        self.foreign = max(0, reported - ours)
        if self.foreign and waiting:
            ours_kv = self.kv_tokens - sum([self.work[rid][1] for rid in waiting])
        else:
            ours_kv = self.kv_tokens
        self.foreign_kv = max(0, kv_used_tokens - ours_kv) if self.foreign else 0

    def batch_at(self, t: float) -> int:
        """The batch at time ``t``: the booked requests that have joined by then (their
        prefill done) and not yet ended. Each joins before it ends, so this is the joined
        count less the ended count."""
        return _sorted.bisect_right(self.joins, t) - _sorted.bisect_right(self.ends, t)

    def admit(
        self, rid: str, end: float, kv: int, blocks: int, join: float = float("-inf")
    ) -> None:
        """Books ``rid``: it joins the batch at ``join`` (when its first token is due; by
        default it is in the batch already) and leaves at ``end``."""
        join = min(join, end)
        _sorted.insort(self.ends, end)
        _sorted.insort(self.joins, join)
        self.join_of[rid] = join
        self.work[rid] = (end, kv, blocks)
        self.kv_tokens += kv
        self.reserved_blocks += blocks
        self.unreported.add(rid)

    def finish(self, rid: str) -> None:
        self.prompts.pop(rid, None)
        self.waiting_blocks -= self.waiting.pop(rid, 0)  # (ended before it reserved)
        w = self.work.pop(rid, None)
        if w is None:
            return
        end, kv, blocks = w
        self.reserve_seq.pop(rid, None)
        if rid in self.unreported:  # ended before a report counted its blocks as used
            self.unreported.discard(rid)
            self.reserved_blocks = max(0, self.reserved_blocks - blocks)
        _remove(self.ends, end)
        _remove(self.joins, self.join_of.pop(rid))
        self.kv_tokens -= kv

    def book_local(self, rid: str, ms: float) -> None:
        """``rid``'s prompt is computed here (a colocated or decode-direct route): its
        predicted ``ms`` wait in this node's local queue until :meth:`unbook_local`."""
        self.local_queue_ms += ms - self.local_booked.get(rid, 0.0)
        self.local_booked[rid] = ms

    def unbook_local(self, rid: str) -> None:
        """``rid``'s prompt is computed, or it ended before (refused by the node, its
        client gone): its share leaves the local queue, once."""
        ms = self.local_booked.pop(rid, None)
        if ms is not None:
            self.local_queue_ms = max(0.0, self.local_queue_ms - ms)

    def joined(self, rid: str, t: float) -> None:
        """``rid``'s first token is out at ``t``: it is in the batch from then on."""
        join = self.join_of.get(rid)
        if join is not None and join > t:
            _remove(self.joins, join)
            _sorted.insort(self.joins, t)
            self.join_of[rid] = t

    def prompt_held(self, rid: str, hashes: Sequence[bytes]) -> None:
        """``rid``'s prompt KV is in place here under ``hashes`` (its full blocks'),
        until :meth:`finish`."""
        if hashes and rid in self.work:
            self.prompts[rid] = hashes

    def held_prefix(self, hashes: Sequence[bytes], most: int) -> int:
        """How many of the first ``most`` of ``hashes`` the prompt of a request decoding
        here holds (the longest such prefix): blocks a request with ``hashes`` pins
        rather than takes from the pool. The hashes are chained (each names its block
        and every block before it), so two prompts share the first i blocks exactly when
        their i-th hashes are equal: a binary search per holder that starts alike."""
        best = 0
        most = min(most, len(hashes))
        if most <= 0:
            return 0
        first = hashes[0]
        for held in self.prompts.values():
            if not held or held[0] != first:
                continue
            lo, hi = 1, min(most, len(held))  # held[:lo] shared; find the last shared
            if hi <= best:
                continue
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if held[mid - 1] == hashes[mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            if lo > best:
                best = lo
                if best == most:
                    break
        return best

    def wait_for_room(self, rid: str) -> None:
        """``rid``, just admitted, reserves on the node only once room frees there: its
        blocks count as waiting (held for it against later requests, kept across load
        reports) until :meth:`room_taken` or :meth:`finish`."""
        w = self.work.get(rid)
        if w is None or rid in self.waiting:
            return
        blocks = w[2]
        if rid in self.unreported:  # (else a report has counted it already: it was not)
            self.unreported.discard(rid)
            self.reserved_blocks = max(0, self.reserved_blocks - blocks)
        self.reserve_seq.pop(rid, None)
        self.waiting[rid] = blocks
        self.waiting_blocks += blocks

    def room_for(self, rid: str) -> bool:
        """Whether waiting ``rid`` has its room here now, by the last report and the
        bookings since, the requests that began waiting before it served first."""
        ahead = 0
        for other, blocks in self.waiting.items():
            if other == rid:
                return self.kv_blocks_free - self.reserved_blocks - ahead >= blocks
            ahead += blocks
        return True

    def room_taken(self, rid: str) -> None:
        """The node reserved ``rid``'s blocks: they count as reserved (until a report
        counts them as used), no longer as waiting."""
        blocks = self.waiting.pop(rid, None)
        if blocks is None:
            return
        self.waiting_blocks -= blocks
        self.reserved_blocks += blocks
        self.unreported.add(rid)

    def room_in(self, need: int, now: float) -> float:
        """In how many ms this node will have ``need`` blocks of room, as the requests
        booked here end at their predicted ends (0 now; infinity if not even once all
        of them have ended)."""
        short = need - self.free_blocks()
        if short <= 0:
            return 0.0
        waiting = self.waiting
        freed = sorted([(w[0], w[2]) for rid, w in self.work.items() if rid not in waiting])
        for end, blocks in freed:
            short -= blocks
            if short <= 0:
                return max(0.0, end - now)
        return float("inf")

    def free_blocks(self) -> int:
        return self.kv_blocks_free - self.reserved_blocks - self.waiting_blocks

    def reserved(self, rid: str, seq: int) -> None:
        """The node reserved ``rid``'s blocks under the number ``seq`` (0: the node does
        not number its reservations). A report that counted it already (its
        ``reserves_seen`` at least ``seq``) came first: its blocks leave
        ``reserved_blocks`` now; else the first such report takes them out."""
        if seq <= 0 or rid not in self.unreported:
            return
        if seq <= self.reports_seen:
            self.unreported.discard(rid)
            w = self.work.get(rid)
            if w is not None:
                self.reserved_blocks = max(0, self.reserved_blocks - w[2])
        else:
            self.reserve_seq[rid] = seq

    def rebook(self, rid: str) -> None:
        """``rid``'s reservation is given back to be taken again (a prefill retry reserves
        afresh under an id of its own): its blocks count as reserved again, from before
        the node frees them until a report made after the new reservation
        (:meth:`reserved`), so no report in between shows them free to the next
        request."""
        w = self.work.get(rid)
        if w is None or rid in self.waiting:
            return
        self.reserve_seq.pop(rid, None)
        if rid not in self.unreported:
            self.unreported.add(rid)
            self.reserved_blocks += w[2]

    def report(self, free: int, total: int, seen: int = 0) -> None:
        """A load report from the node: its free blocks count the reservations it had made
        when it made the report, those numbered up to ``seen`` (0: it does not number
        them; all of ours are taken as counted). Ours that it had not made yet (their
        Reserve still on its way, or numbered after ``seen``) still count in
        ``reserved_blocks``: a report made before a reservation and read after its
        booking must not free its blocks. A number that goes back (the node's clock did)
        resets to the rule without numbers."""
        self.kv_blocks_free, self.kv_blocks_total = free, total
        if seen <= 0 or seen < self.reports_seen:  # not numbered, or numbers went back
            self.reports_seen = seen if seen > 0 else 0
            self.reserved_blocks = 0
            self.unreported.clear()
            self.reserve_seq.clear()
            return
        self.reports_seen = seen
        if not self.unreported:
            self.reserved_blocks = 0
            return
        keep = set()
        blocks = 0
        seqs = self.reserve_seq
        for rid in self.unreported:
            n = seqs.get(rid, 0)
            if n == 0 or n > seen:  # not reserved yet, or after the report was made
                keep.add(rid)
                w = self.work.get(rid)
                if w is not None:
                    blocks += w[2]
            elif n:
                del seqs[rid]
        self.unreported = keep
        self.reserved_blocks = blocks


def _remove(xs: list[float], x: float) -> None:
    """Removes one ``x`` from the sorted list ``xs`` (if there)."""
    i = _sorted.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        xs.pop(i)
