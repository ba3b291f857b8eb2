"""Warm-ups: a prompt refused for its TTFT still leaves its KV behind for the next.

Admission refuses a request whose first token it cannot deliver in time; when that
request is the first of many sharing a prefix (a document, a long system prompt), no
request of them would ever be accepted, since none finds the prefix cached: each is
as slow as the first. In the evaluation's trace, 5 of the 16 requests kvmesh refused at
7.3 requests/s were served in ~100 ms by the colocated baseline, from a prefix its
local cache held because it had served (late) the request kvmesh refused.

So a refused prompt whose full blocks no node holds is handed to an idle prefill node
as a warm-up (``PrefillRequest.warm``): the node computes those blocks into its prefix
cache and the store only while no request waits for its compute slot, and stops for the
first that does. The refusal stands; the KV is there for whoever shares the prefix.

Only a prompt others may share is worth it: one whose first blocks are cached
somewhere (a part of its prefix), or whose first block began a prompt refused before,
or one refused as infeasible (no node could ever compute it in time: without a warm-up
no request sharing its prefix could ever be served, and the same prompt sent again is
served from the cache). A unique prompt refused for the load of the moment is not
computed at all (early rejection's point): of a group refused for load, the second
refused request is the one warmed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.conductor.candidates import Decision, Request
from kvmesh.services.conductor.cluster import ClusterView
from kvmesh.services.conductor.node_calls import NodeCalls
from kvmesh.services.conductor.policy import INFEASIBLE, Scheduler

log = logging.getLogger(__name__)

WARM_TIMEOUT_S = 60.0  # a warm-up that has not ended by then is given up
_RECENT = 4096  # prompts warmed lately (the index may not show their blocks yet)


class Warmer:
    """Sends warm-ups for refused prompts: at most one per prefill node at a time, to a
    node with nothing queued by this conductor, each prompt once."""

    def __init__(self, sched: Scheduler, view: ClusterView, calls: NodeCalls) -> None:
        self.sched, self.view, self.calls = sched, view, calls
        self.pending: dict[str, bytes] = {}  # prefill node -> the prompt it warms
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self._starts: OrderedDict[bytes, None] = OrderedDict()  # first blocks refused
        self.sent = 0
        self.done = 0

    def refused(self, r: Request, d: Decision, tokens: list[int], block_size: int) -> bool:
        """Warms ``r``'s full blocks if it was refused for its TTFT and they are neither
        cached nor being warmed; True if a warm-up was sent."""
        k = len(r.hashes)
        best = d.estimate
        if d.reason not in ("ttft", INFEASIBLE) or k < 2 or best is None:
            return False
        held = best.cached_blocks + best.fetch_blocks
        if held >= (len(tokens) - 1) // block_size:
            return False  # all it could use is cached: nothing to warm
        start = r.hashes[0]
        shared = held > 0 or start in self._starts or d.reason == INFEASIBLE
        self._starts[start] = None
        self._starts.move_to_end(start)
        if len(self._starts) > _RECENT:
            self._starts.popitem(last=False)
        if not shared:
            return False
        key = r.hashes[-1]
        if key in self._recent or key in self.pending.values():
            return False
        idle = [
            p
            for p in self.sched.prefill.values()
            if p.node_id not in self.pending and not p.queue and not p.foreign
        ]
        if not idle:
            return False
        node_id = min(idle, key=lambda p: p.foreign_ms).node_id
        self.pending[node_id] = key
        self._recent[key] = None
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
        self.sent += 1
        self.calls.spawn(self._warm(node_id, r, tokens[: k * block_size]))
        return True

    async def _warm(self, node_id: str, r: Request, tokens: list[int]) -> None:
        try:
            node = self.calls.node("prefill", node_id)
            await self.view.prefill_stub(node).Prefill(
                pb.PrefillRequest(
                    request_id=f"warm.{r.request_id}",
                    token_ids=tokens,
                    block_hashes=r.hashes,
                    warm=True,
                ),
                timeout=WARM_TIMEOUT_S,
            )
            self.done += 1
        except grpc.aio.AioRpcError as e:  # busy, yielded, gone: the next refusal may try
            self._recent.pop(r.hashes[-1], None)
            log.debug("warm-up of %s on %s: %s", r.request_id, node_id, e.details())
        except Exception as e:  # (a node that left: Rejected)
            self._recent.pop(r.hashes[-1], None)
            log.debug("warm-up of %s on %s: %s", r.request_id, node_id, e)
        finally:
            self.pending.pop(node_id, None)
