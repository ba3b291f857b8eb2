"""The conductor's calls to the nodes on a request's behalf: the decode reservation
(``Reserve``, and ``Release`` when the request ends before its ``Decode`` call owns it),
and the ``Prefill`` call with its retries on other nodes.

A reservation belongs to an :class:`Attempt`. A prefill retried on another node first
gives back the failed attempt's reservation, naming the nodes that may still write it (the
decode node fences those blocks), then reserves afresh under an id of its own. Releases
run in tasks of their own (``background``) that a client going away cannot stop; the
conductor waits for them at shutdown."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common import metrics as METRICS
from kvmesh.services.common.ownership import WRITERS_MD
from kvmesh.services.conductor.cluster import ClusterView, NodeInfo
from kvmesh.services.conductor.frontend import Rejected
from kvmesh.services.conductor.policy import DISAGG, KV_RETRY_MS, Decision, Request

log = logging.getLogger(__name__)


@dataclass
class Attempt:
    """The decode reservation one prefill attempt writes into: the id the nodes know the
    attempt by, its KV target, and the prefill nodes asked to write it. A retry on another
    node gets a fresh one (``NodeCalls.prefill``), so nothing the failed node may still
    write or notify lands in blocks the retry owns."""

    rid: str
    target: pb.KVTarget
    writers: list[str]
    hashes: Sequence[bytes] = ()  # named at Reserve: the decode node pins their prefix


class NodeCalls:
    """Reserve, release and prefill calls to the nodes of ``view``. ``owner_metadata``
    gives the metadata that ties a reservation to this conductor's incarnation (freed
    when it ends); ``request_timeout_s`` bounds a prefill call."""

    def __init__(
        self,
        view: ClusterView,
        owner_metadata: Callable[[], tuple[tuple[str, str], ...]],
        request_timeout_s: float,
    ) -> None:
        self.view = view
        self.owner_metadata = owner_metadata
        self.request_timeout_s = request_timeout_s
        self.background: set[asyncio.Task] = set()  # releases outliving their request
        # a prefill retry's new decode reservation: (r, d, None) before the old one is
        # given back, (r, d, its number) once the new one is made (the scheduler's booking)
        self.on_retry_reserve: Callable[[Request, Decision, int | None], None] | None = None
        self._room: dict[str, asyncio.Event] = {}  # per decode node: a request there ended

    def node(self, role: str, node_id: str) -> NodeInfo:
        for n in self.view.nodes(role):
            if n.node_id == node_id:
                return n
        raise Rejected(grpc.StatusCode.UNAVAILABLE, f"{role} node {node_id} left; retry")

    async def reserve(
        self,
        d: NodeInfo,
        rid: str,
        n: int,
        max_tokens: int,
        hashes: Sequence[bytes] = (),
        prefill_here: bool = False,
    ) -> pb.ReserveResponse:
        """Reserves KV for ``rid`` on ``d``. ``hashes``: the prompt's full blocks'; the
        node pins the cached prefix they name before it takes blocks for the rest
        (``cached_tokens`` says how much; a prefill node writes only the rest).
        ``prefill_here``: ``d`` computes the prompt itself."""
        req = pb.ReserveRequest(
            request_id=rid,
            prompt_tokens=n,
            max_tokens=max_tokens,
            block_hashes=hashes,
            prefill_here=prefill_here,
        )
        try:
            return await self.view.decode_stub(d).Reserve(
                req,
                timeout=5,
                metadata=self.owner_metadata(),  # freed when it ends
            )
        except asyncio.CancelledError:  # the client went away: the node may have reserved
            self.spawn(self.release(d, rid, []))
            raise
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code not in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.ALREADY_EXISTS,
            ):
                code = grpc.StatusCode.UNAVAILABLE
            # out of blocks: the node's pool filled before its load report said so; a
            # refusal for KV room, as admission's own (same reason, same retry hint)
            full = code == grpc.StatusCode.RESOURCE_EXHAUSTED
            raise Rejected(
                code,
                f"decode node {d.node_id} could not reserve KV for "
                f"{n + max_tokens} tokens ({e.details()}); retry"
                + (f" after {KV_RETRY_MS:.0f} ms" if full else ""),
                (("retry-after-ms", f"{KV_RETRY_MS:.0f}"), ("kvmesh-reject-reason", "kv"))
                if full
                else (),
            ) from None

    async def reserve_when_room(
        self,
        d: NodeInfo,
        rid: str,
        n: int,
        max_tokens: int,
        hashes: Sequence[bytes],
        prefill_here: bool,
        wait_s: float,
        ready: Callable[[], bool] = lambda: True,
    ) -> pb.ReserveResponse:
        """As :meth:`reserve`, for a request admitted to wait for KV room on ``d``: asks
        when ``ready`` says the room is there (the conductor's view: the node's free
        blocks less what its requests may still grow into, and the waiters ahead), each
        time a request there ends and every 100 ms, for up to ``wait_s``; then the
        refusal for KV room."""
        until = time.monotonic() + wait_s
        while True:
            if ready():
                try:
                    return await self.reserve(d, rid, n, max_tokens, hashes, prefill_here)
                except Rejected as e:
                    if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    METRICS.RESERVES_REFUSED.inc()  # (the view said there was room)
            left = until - time.monotonic()
            if left <= 0:
                # (reason "wait": refused after a wait, not at admission like "kv")
                raise Rejected(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"decode node {d.node_id} had no KV room for {n + max_tokens} tokens "
                    f"within the {wait_s * 1000:.0f} ms its TTFT SLO left to wait; retry "
                    f"after {KV_RETRY_MS:.0f} ms",
                    (("retry-after-ms", f"{KV_RETRY_MS:.0f}"), ("kvmesh-reject-reason", "wait")),
                )
            ended = self._room.setdefault(d.node_id, asyncio.Event())
            try:
                async with asyncio.timeout(min(left, 0.1)):
                    await ended.wait()
            except TimeoutError:
                pass

    def room_freed(self, node_id: str | None) -> None:
        """A request on decode node ``node_id`` ended: requests waiting for KV room
        there ask again."""
        ended = self._room.pop(node_id, None) if node_id else None
        if ended is not None:
            ended.set()

    async def release(self, d: NodeInfo, rid: str, writers: list[str]) -> None:
        """Frees ``rid``'s reservation on ``d`` (a no-op once its Decode call owns it),
        naming the prefill nodes that may write it (``writers``). Release is idempotent:
        a node that did not answer is asked again (three tries in all), since a missed
        release holds the blocks until the decode node's owner reaper."""
        for attempt in range(3):
            try:
                await self.view.decode_stub(d).Release(
                    pb.ReleaseRequest(request_id=rid),
                    timeout=5,
                    metadata=((WRITERS_MD, json.dumps(writers)),),
                )
                return
            except grpc.aio.AioRpcError as e:
                again = e.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
                if not again or attempt == 2:
                    log.warning("releasing %s on %s failed: %s", rid, d.node_id, e.code())
                    return
                await asyncio.sleep(0.2 * (attempt + 1))

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def unless_gone(self, node: NodeInfo, call, poll_s: float = 0.25):
        """Awaits the unary ``call`` to ``node``, cancelling it with UNAVAILABLE once the
        node leaves the membership (lease expired: e.g. cut off by the network, where the
        call would otherwise hang until its deadline with no RST to end it)."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll_s)
                if done:
                    return task.result()
                if all(n.node_id != node.node_id for n in self.view.nodes(node.role)):
                    raise Rejected(
                        grpc.StatusCode.UNAVAILABLE,
                        f"{node.role} node {node.node_id} left the cluster mid-request",
                    )
        finally:
            if not task.done():
                task.cancel()

    async def prefill(
        self,
        r: Request,
        d: Decision,
        tokens,
        req,
        dnode: NodeInfo,
        att: Attempt,
        due: float | None = None,
        block_size: int = 0,
    ):
        """Prefill on the chosen node; a node that fails is skipped for the next
        disaggregated candidate (at most three tries). With ``due`` (``perf_counter``
        seconds: when the first token is due at the client, by admission's rule: within the
        SLO margin's share of the SLO; ``block_size``: the model's), each node is told the time
        left and its estimated time on the request, and a node that refuses the request as
        too late ends the request (RESOURCE_EXHAUSTED, reason ``deadline``): no other node
        would start it sooner than the estimate that admitted it. Each node asked is added to
        ``att.writers`` before it is asked. A retry first gives back the failed attempt's
        reservation (naming its writers: the decode node fences those blocks until they
        are done) and reserves afresh under an id of its own (``<id>.retry<k>``): the failed
        node may still write its blocks or say they are ready, which must not reach
        blocks the retry owns. The client sees the request's own id throughout."""
        first = d.prefill_node
        if first is None:
            raise ValueError("only a disaggregated decision has a prefill node")
        order = [first] + [c.node for c in d.candidates if c.route == DISAGG and c.node != first]
        last = ""
        for k, node_id in enumerate(order[:3]):
            if att.writers:  # an earlier attempt asked a node: this is a retry
                # the old reservation goes first (a full decode node may need its blocks
                # for the new one); shielded, so a client leaving now cannot stop it
                if self.on_retry_reserve is not None:
                    self.on_retry_reserve(r, d, None)
                release = asyncio.ensure_future(self.release(dnode, att.rid, att.writers))
                self.background.add(release)
                release.add_done_callback(self.background.discard)
                await asyncio.shield(release)
                att.rid, att.writers = f"{r.request_id}.retry{k}", []
                try:
                    reserved = await self.reserve(
                        dnode, att.rid, len(tokens), req.max_tokens, att.hashes
                    )
                    att.target = reserved.target
                    if self.on_retry_reserve is not None:
                        self.on_retry_reserve(r, d, reserved.reserve_seq)
                except Rejected as e:  # no room for the retry ends the request
                    raise Rejected(
                        e.code,
                        f"prefill on {order[k - 1]} failed ({last}) and {e.message}",
                        (("retry-after-ms", "1000"), ("kvmesh-reject-reason", "retry_reserve")),
                    ) from None
            try:
                node = self.node("prefill", node_id)
                att.writers.append(node_id)
                resp = await self.unless_gone(
                    node,
                    self.view.prefill_stub(node).Prefill(
                        pb.PrefillRequest(
                            request_id=att.rid,
                            token_ids=tokens,
                            block_hashes=r.hashes,
                            target=att.target,
                            sampling=req.sampling,
                            **_deadline(d, node_id, due, len(tokens), block_size),
                        ),
                        timeout=self.request_timeout_s,
                    ),
                )
                return resp, node
            except grpc.aio.AioRpcError as e:
                last = f"{node_id}: {e.code().name} {e.details()}"
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise Rejected(e.code(), e.details()) from None
                if _refused_late(e):
                    raise Rejected(
                        e.code(),
                        f"request {r.request_id} cannot meet its TTFT SLO of "
                        f"{r.ttft_slo_ms + r.ttft_spent_ms:.0f} ms (with admission's margin): "
                        f"{e.details()}; retry later or with a looser SLO",
                        (("retry-after-ms", "1000"), ("kvmesh-reject-reason", "deadline")),
                    ) from None
                log.warning("prefill on %s failed (%s); trying the next node", node_id, last)
            except Rejected as e:
                last = e.message
                log.warning("prefill on %s failed (%s); trying the next node", node_id, last)
        raise Rejected(
            grpc.StatusCode.UNAVAILABLE,
            f"prefill failed on every candidate (last: {last}); retry the request",
        )


def _deadline(d: Decision, node_id: str, due: float | None, n: int, bs: int) -> dict:
    """The Prefill call's deadline fields for ``node_id`` (``{}`` without ``due``): the ms
    left until ``due``, the node's estimated time on the request and the prompt tokens
    that estimate has it compute (of ``n``, at block size ``bs``). The estimate's overhead
    is not taken off the time left: most of it (the reservation, the call) is spent by
    now, and the way back to the client is within the SLO margin's headroom."""
    if due is None:
        return {}
    c = next((c for c in d.candidates if c.route == DISAGG and c.node == node_id), d.estimate)
    if c is None:
        return {}
    return {
        # a request already late is still sent, with a deadline the node refuses at once
        "deadline_ms": max(0.001, (due - time.perf_counter()) * 1000),
        "expected_ms": c.work_ms * c.speed,
        "expected_computed_tokens": max(1, n - (c.cached_blocks + c.fetch_blocks) * bs),
    }


def _refused_late(e: grpc.aio.AioRpcError) -> bool:
    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    md = e.trailing_metadata() or ()
    return any(k == "kvmesh-reject-reason" and v == "deadline" for k, v in md)
