"""conductor: the client API and the cluster's scheduler.

A request's life here (``Generate``, server-streaming):
  1. validate: model served, prompt non-empty, max_tokens > 0, prompt + max_tokens within
     the model's context, sampling in range -> else INVALID_ARGUMENT;
  2. tokenize and cut into blocks; each full block gets a prefix hash chained to its
     predecessor and seeded with the model fingerprint and the tenant salt;
  3. estimate TTFT on every candidate prefill node (queue + prefill + fetch + handoff,
     see ``estimator``); if even the best misses the TTFT SLO -> RESOURCE_EXHAUSTED at
     once, before any work starts (``rejected``);
  4. reserve KV blocks on the least-loaded decode node (``Reserve``);
  5. ``Prefill`` on the chosen node, which streams KV layer by layer into the reservation
     (``prefilling``; the node's predicted time counts in its queue meanwhile);
  6. ``Decode`` on the decode node; the first token goes to the client once the decode
     node says the request is in its running batch (``hold_first_token``: the first step
     holding it has begun, so the second token is one step behind; a colocated request's
     decode node holds its own first token so; at most until the TTFT SLO is up); tokens
     are relayed as they come (``decoding``); the last message carries finish_reason
     and usage. The first token's time, the hold included, is the TTFT the route's
     learned overhead and error tail see: admission counts the wait to join.
A node that fails before the first token is skipped for the next candidate; one that
fails afterwards ends the stream with UNAVAILABLE (the client retries).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
import uuid
from collections import deque
from typing import Any

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common import channels
from kvmesh.services.common import metrics as METRICS
from kvmesh.services.common.auth import (
    ApiKeyInterceptor,
    ApiKeys,
    StrictDecoding,
    current_principal,
    tenant_seed,
)
from kvmesh.services.common.config import load
from kvmesh.services.common.etcd import EtcdError
from kvmesh.services.common.hashing import prefix_hashes
from kvmesh.services.common.limits import check_names, shown
from kvmesh.services.common.metrics import REGISTRY as METRICS_REGISTRY
from kvmesh.services.common.metrics import RequestStats
from kvmesh.services.common.ownership import OwnerKey
from kvmesh.services.common.registry import Membership, nodes_prefix
from kvmesh.services.common.service import Service, run, setup_logging
from kvmesh.services.common.telemetry import record_span
from kvmesh.services.conductor.cluster import ClusterView, NodeInfo
from kvmesh.services.conductor.config import ConductorConfig
from kvmesh.services.conductor.feeds import NodeFeeds
from kvmesh.services.conductor.frontend import Rejected, client_id
from kvmesh.services.conductor.http_api import HttpApi
from kvmesh.services.conductor.model_metrics import ModelErrorCollector
from kvmesh.services.conductor.node_calls import Attempt, NodeCalls
from kvmesh.services.conductor.observe import admission_attributes, cluster_status, observed
from kvmesh.services.conductor.policy import (
    DISAGG,
    INFEASIBLE,
    Decision,
    Request,
    Scheduler,
)
from kvmesh.services.conductor.request_input import RequestInput
from kvmesh.services.conductor.text import TextStream, generate_response
from kvmesh.services.conductor.vllm_metrics import KvUsageCollector
from kvmesh.services.conductor.warm import Warmer

log = logging.getLogger(__name__)


class ConductorServicer(pbg.ConductorServicer):
    def __init__(self, c: Conductor) -> None:
        self.c = c

    async def Generate(self, req, context):
        principal = current_principal.get()
        client_id.set(
            principal.tenant
            if self.c.api_keys.enabled
            else (context.peer() or "").rsplit(":", 1)[0]
        )
        try:
            async for resp in observed(self.c, req):
                yield resp
        except Rejected as e:
            if e.metadata:
                context.set_trailing_metadata(e.metadata)
            await context.abort(e.code, e.message)

    async def ClusterStatus(self, req, context):
        return await self.c.cluster_status()


class Conductor(Service):
    """The conductor service; implements ``frontend.ConductorApi`` for its front ends."""

    role = "conductor"
    api_keys: ApiKeys  # set by server_interceptors, during Service.__init__

    def server_interceptors(self) -> list:
        self.api_keys = ApiKeys.from_config(self.cfg.api_key_entries, self.cfg.api_keys_file)
        return [
            StrictDecoding(),
            *([ApiKeyInterceptor(self.api_keys)] if self.api_keys.enabled else []),
        ]

    def __init__(self, cfg: ConductorConfig) -> None:
        super().__init__(cfg)
        self.cfg: ConductorConfig = cfg
        self.membership = Membership(self.etcd, nodes_prefix(cfg.cluster))
        self.view = ClusterView(self.membership)
        self.sched = Scheduler(cfg.policy_config())
        self.feeds = NodeFeeds(self.view, self.sched, cfg.report_interval_ms)
        self.input = RequestInput.of(self.view, cfg)
        self.request_stats = RequestStats()
        self.http: HttpApi | None = None
        self.decisions: deque[dict] = deque(maxlen=1024)
        self._streams: collections.Counter[str] = collections.Counter()
        self._ids_in_flight: set[tuple[str, str]] = set()  # (tenant, client's request_id)
        self._draining = False  # no new requests
        self._abort_streams = False  # in-flight streams end with UNAVAILABLE
        # owns this process's decode reservations until teardown, after the drain
        self.owner = OwnerKey(self.etcd, cfg.cluster, self.role, self.node_id, cfg.lease_ttl)
        self.calls = NodeCalls(
            self.view, lambda: self.owner.metadata(self.node_id), cfg.request_timeout_s
        )
        self.feeds.on_report = self.calls.room_freed
        warm = cfg.warm_refused and cfg.policy == "kvmesh"
        self.warmer = Warmer(self.sched, self.view, self.calls) if warm else None
        self.calls.on_retry_reserve = self._retry_reserve

    async def setup(self) -> None:
        pbg.add_ConductorServicer_to_server(ConductorServicer(self), self.server)
        if self.cfg.http_port >= 0:
            # HTTPS with the gRPC port's certificate when TLS is on
            self.http = HttpApi(
                self,
                self.cfg.host,
                self.cfg.http_port,
                channels.current(),
                idle_timeout_s=self.cfg.http_idle_timeout_s,
            )
            self.http_address = self.cfg.advertise(await self.http.start())
            self.membership.add_listener(self.http.on_member)
        self.membership.add_listener(self.feeds.on_member)
        self._model_metrics = ModelErrorCollector(self.sched)
        METRICS_REGISTRY.register(self._model_metrics)
        self._kv_usage = KvUsageCollector(self.sched, self.view, self.input.public_name)
        METRICS_REGISTRY.register(self._kv_usage)
        await self.membership.start()

    async def register(self) -> None:
        await super().register()
        await self.owner.start()

    async def drain(self) -> None:
        """In-flight streams get ``drain_timeout_s`` to finish; the rest end with a status."""
        self._draining = True
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._abort_streams = True
        deadline = time.monotonic() + 2
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def teardown(self) -> None:
        if self.http is not None:
            await self.http.stop()
        METRICS_REGISTRY.unregister(self._model_metrics)
        METRICS_REGISTRY.unregister(self._kv_usage)
        if self.calls.background:  # reservations being released
            await asyncio.wait(self.calls.background, timeout=5)
        try:  # the decode nodes free what this incarnation still holds
            async with asyncio.timeout(3):
                await self.owner.stop()
        except (TimeoutError, EtcdError) as e:
            log.warning("deleting the owner key failed (%s); its lease will expire", e)
        await self.feeds.close()
        await self.membership.stop()
        await self.view.close()

    def model_label(self, requested: str) -> str:
        return self.input.label(requested)

    def model_info(self, requested: str) -> tuple[str, dict, Any]:
        model, info = self.input.lookup(requested)
        return model, info, self.input.tokenizer(info)

    # -- admission -----------------------------------------------------------------------
    async def _store_prefix(self, hashes: list[bytes]) -> int | None:
        stub = self.view.store_stub()
        if not hashes or stub is None:
            return 0
        try:
            resp = await stub.Exists(pb.ExistsRequest(hashes=hashes), timeout=1)
            return resp.prefix_blocks
        except grpc.aio.AioRpcError:
            return 0

    async def _decide(self, r: Request, fp: str) -> Decision:
        """The scheduler's decision among the nodes serving fingerprint ``fp``."""
        fps = self.feeds.fingerprint_of
        if any(fps.get(n) != fp for n in (*self.sched.prefill, *self.sched.decode)):
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "nodes of several model fingerprints are live; serving more than "
                "one model per cluster is not supported yet",
            )
        store_prefix = None if self.feeds.store_live else await self._store_prefix(r.hashes)
        return self.sched.decide(r, store_prefix)

    # -- the request's life --------------------------------------------------------------
    async def generate(self, req: pb.GenerateRequest):
        """The request's life (module docstring), within the per-client stream limit and
        the shutdown drain."""
        if self._draining:
            raise Rejected(
                grpc.StatusCode.UNAVAILABLE,
                "this conductor is shutting down; retry on another conductor",
            )
        client = client_id.get()
        if self._streams[client] >= self.cfg.max_streams_per_client:
            raise Rejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"client {client!r} already has {self._streams[client]} streams "
                f"open (limit {self.cfg.max_streams_per_client}); retry when one "
                f"ends",
                (("retry-after-ms", "1000"), ("kvmesh-reject-reason", "client_streams")),
            )
        if err := check_names(req.model, req.request_id):  # (before either is echoed)
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, err)
        # a client's request_id is unique among its tenant's requests in flight here
        key = (current_principal.get().tenant, req.request_id)
        if req.request_id and key in self._ids_in_flight:
            raise Rejected(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {shown(req.request_id)} is already in flight; give each "
                f"concurrent request its own request_id (or none: one is generated)",
            )
        self._streams[client] += 1
        if req.request_id:
            self._ids_in_flight.add(key)
        try:
            async for resp in self._generate(req):
                if self._abort_streams:
                    raise Rejected(
                        grpc.StatusCode.UNAVAILABLE,
                        "this conductor shut down before the stream ended; retry the request",
                    )
                yield resp
        finally:
            self._ids_in_flight.discard(key)
            self._streams[client] -= 1
            if not self._streams[client]:
                del self._streams[client]

    async def _generate(self, req: pb.GenerateRequest):
        t_arrival = time.perf_counter()
        model, fp = self.input.resolve_model(req.model)
        info = next(
            n.raw
            for n in self.view.nodes("prefill") + self.view.nodes("decode")
            if n.fingerprint == fp
        )
        tokens = await self.input.tokens(req, info)
        if not req.sampling.HasField("seed"):
            # fresh randomness for each request, drawn once: a prefill retry or another
            # node samples from the same seed, so the request's tokens stay the same
            req.sampling.seed = secrets.randbits(64)
        # the id the nodes know the request by is unique (clients and tenants may repeat
        # theirs); responses carry the client's
        rid = f"{req.request_id}.{uuid.uuid4().hex[:12]}" if req.request_id else uuid.uuid4().hex
        bs = int(info["block_size"])
        hashes = prefix_hashes(
            bytes.fromhex(fp) + tenant_seed() + req.cache_salt.encode(), tokens, bs
        )  # the tenant's namespace first: see common.auth
        ttft_slo = min(req.slo.ttft_ms or self.cfg.ttft_slo_ms, self.cfg.ttft_slo_ms)
        tbt_slo = min(req.slo.tbt_ms or self.cfg.tbt_slo_ms, self.cfg.tbt_slo_ms)
        # the time this request already spent here (parsing, hashing, lookups) counts too
        spent_ms = (time.perf_counter() - t_arrival) * 1000
        r = Request(
            rid, len(tokens), hashes, req.max_tokens, ttft_slo - spent_ms, tbt_slo, spent_ms
        )
        t_admit = time.time_ns()
        d = await self._decide(r, fp)
        record_span("conductor.admission", t_admit, attributes=admission_attributes(r, d))
        if not d.accepted:
            if self.warmer is not None:  # its prefix's KV, for the requests that share it
                self.warmer.refused(r, d, tokens, bs)
            if d.reason == INFEASIBLE:  # no node could ever serve it: a retry cannot help
                raise Rejected(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    d.message,
                    (("kvmesh-reject-reason", d.reason),),
                )
            code = (
                grpc.StatusCode.UNAVAILABLE
                if d.reason == "no-nodes"
                else grpc.StatusCode.RESOURCE_EXHAUSTED
            )
            meta: tuple[tuple[str, str], ...] = (
                ("retry-after-ms", f"{d.retry_after_ms:.0f}"),
                ("kvmesh-reject-reason", d.reason),
            )
            if d.estimate is not None:
                meta += (("kvmesh-estimated-ttft-ms", f"{d.estimate.ttft_ms:.1f}"),)
            raise Rejected(code, d.message, meta)
        self.sched.commit(r, d)
        estimate, decode_node = d.booked()
        record = {
            "request_id": req.request_id or rid,
            "node_request_id": rid,
            "route": d.route,
            "prefill": d.prefill_node,
            "decode": decode_node,
            "estimated_ttft_ms": estimate.ttft_ms,
            "candidates": [(c.route, c.node, round(c.ttft_ms, 2)) for c in d.candidates],
        }
        self.decisions.append(record)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "decision %s; candidates (route node: ttft [queue + work x speed; fetch, hand-off "
                "and overhead make up the rest], cached+fetched blocks): %s",
                record,
                "; ".join(
                    f"{c.route} {c.node}: {c.ttft_ms:.1f} = {c.queue_ms:.1f} + {c.work_ms:.1f} x "
                    f"{c.speed:.2f}, {c.cached_blocks}+{c.fetch_blocks}"
                    for c in d.candidates
                ),
            )
        produced = 0
        try:
            async for resp in self._serve(r, d, req, tokens, t_arrival, record, info):
                produced += len(resp.token_ids)
                yield resp
        finally:
            # a request refused or failed before its first token says nothing about
            # how much of max_tokens requests use
            self.sched.request_done(r, d, produced or None)
            self.calls.room_freed(d.decode_node)

    async def _serve(
        self,
        r: Request,
        d: Decision,
        req: pb.GenerateRequest,
        tokens: list[int],
        t_arrival: float,
        record: dict,
        info: dict,
    ):
        rid = r.request_id
        estimate, decode_node = d.booked()
        dnode = self.calls.node("decode", decode_node)
        local = d.route != DISAGG
        # disaggregated, the decode node may keep its cached prefix and have only the rest
        # written, if every prefill node that may write it (a retry's too) knows how
        share = local or all(n.raw.get("kv_target_held_blocks") for n in self.view.nodes("prefill"))
        hashes = r.hashes if share else ()
        reserved = await self._reserve(r, d, dnode, len(tokens), req.max_tokens, hashes, record)
        att = Attempt(rid, reserved.target, [], hashes)
        decoded: list[bool] = []  # set once the Decode call ended (and freed it)
        try:
            if local and reserved.prefix_pinned:  # (a node that did not pin says nothing)
                bs = int(info["block_size"])
                late = self.sched.held_locally(r, d, reserved.cached_tokens // bs)
                record["estimated_ttft_ms"] = estimate.ttft_ms  # (the truth, if it moved)
                if late:  # the index counted on blocks the node no longer holds
                    why, retry = late
                    raise Rejected(  # (reason "evicted": refused after its Reserve)
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{why}; retry after {retry:.0f} ms",
                        (("retry-after-ms", f"{retry:.0f}"), ("kvmesh-reject-reason", "evicted")),
                    )
            async for resp in self._serve_reserved(
                r, d, req, tokens, t_arrival, record, info, dnode, att, decoded
            ):
                yield resp
        finally:
            if not decoded:
                # failed, or the client went away (a cancellation lands here, queued,
                # prefilling, transferring or decoding): the reservation goes at once,
                # in a task of its own that a second cancellation cannot stop; the decode
                # node frees it now if every writer has said it is done, else after a fence
                self.calls.spawn(self.calls.release(dnode, att.rid, att.writers))

    def _retry_reserve(self, r: Request, d: Decision, seq: int | None) -> None:
        if seq is None:
            self.sched.rebook(r, d)
        else:
            self.sched.reserved(r, d, seq)

    async def _reserve(self, r, d, dnode, n, max_tokens, hashes, record) -> pb.ReserveResponse:
        """The decode reservation: at once, or once the node has room where admission
        said to wait for it, or where the node refuses for want of blocks (its pool
        filled before its report said so) and the TTFT SLO leaves time to wait."""
        local = d.route != DISAGG
        wait_ms = d.kv_wait_ms
        if wait_ms <= 0:
            try:
                reserved = await self.calls.reserve(
                    dnode, r.request_id, n, max_tokens, hashes, local
                )
                self.sched.reserved(r, d, reserved.reserve_seq)
                return reserved
            except Rejected as e:
                if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                METRICS.RESERVES_REFUSED.inc()
                wait_ms = self.sched.kv_slack_ms(r, d)
                if wait_ms <= 0:
                    raise
                self.sched.await_room(r, d)
                METRICS.KV_WAITS.labels("reserve_refused").inc()
        else:
            METRICS.KV_WAITS.labels("admission").inc()
        t_wait = time.perf_counter()
        reserved = await self.calls.reserve_when_room(
            dnode,
            r.request_id,
            n,
            max_tokens,
            hashes,
            local,
            wait_ms / 1000,
            lambda: self.sched.room_now(r, d),
        )
        record["kv_wait_ms"] = (time.perf_counter() - t_wait) * 1000
        self.sched.room_taken(r, d)
        self.sched.reserved(r, d, reserved.reserve_seq)
        return reserved

    async def _serve_reserved(
        self,
        r: Request,
        d: Decision,
        req: pb.GenerateRequest,
        tokens: list[int],
        t_arrival: float,
        record: dict,
        info: dict,
        dnode: NodeInfo,
        att: Attempt,
        decoded: list[bool],
    ):
        out_rid = req.request_id or r.request_id
        estimate, _ = d.booked()
        tok = self.input.tokenizer(info)
        decoder = TextStream(tok, tuple(req.sampling.stop))
        eos_ids = frozenset(info.get("eos_ids") or [tok.eos_id])
        usage = pb.Usage(prompt_tokens=len(tokens))
        route = pb.Route(decode_node=dnode.node_id, estimated_ttft_ms=estimate.ttft_ms)
        dreq = pb.DecodeRequest(
            request_id=att.rid,
            max_tokens=req.max_tokens,
            sampling=req.sampling,
            prompt_token_ids=tokens,
            block_hashes=r.hashes,
            tbt_slo_ms=r.tbt_slo_ms,  # (the decode node's prompt chunks leave room for it)
        )
        # the first token waits until the decode node has the request in its batch
        hold = self.cfg.hold_first_token and bool(dnode.raw.get("reports_join"))
        dreq.report_join = hold
        first: pb.GenerateResponse | None = None
        presp: pb.PrefillResponse | None = None
        retried = False
        if d.route == DISAGG:
            # the node re-checks admission's own rule at the start of the work, with
            # fresh facts: the first token within the margin's share of what was left
            due = t_arrival + (r.ttft_spent_ms + r.ttft_slo_ms * self.cfg.slo_margin) / 1000
            presp, pnode = await self.calls.prefill(
                r,
                d,
                tokens,
                req,
                dnode,
                att,
                due if self.cfg.refuse_late else None,
                int(info["block_size"]),
            )
            dreq.request_id = record["node_request_id"] = att.rid  # a retry's own
            route.prefill_node = pnode.node_id
            dreq.first_token = presp.first_token
            retried = pnode.node_id != d.prefill_node
            first = generate_response(
                out_rid, [presp.first_token], decoder, usage, presp, route, req, eos_ids
            )
            if not hold or first.finish_reason:
                self._first_token_seen(r, d, presp, t_arrival, record, learn=not retried)
                yield first  # the caller releases the reservation if this is the last
                if first.finish_reason:
                    return
                first = None
        else:
            dreq.prefill_here = True
        stream = self.view.decode_stub(dnode).Decode(dreq, timeout=self.cfg.request_timeout_s)
        messages = stream.__aiter__()
        nxt: asyncio.Future | None = None
        held = not att.hashes
        try:
            if first is not None:
                # held until the decode node's first message (joined: its first step has
                # begun; an error; a token from a node that does not report joins), at
                # most until the TTFT SLO is up; then it goes, whatever came
                t_hold = time.perf_counter()
                nxt = asyncio.ensure_future(messages.__anext__())
                slo_end = t_arrival + (r.ttft_spent_ms + r.ttft_slo_ms) / 1000
                await asyncio.wait({nxt}, timeout=max(0.0, slo_end - t_hold))
                record["join_hold_ms"] = (time.perf_counter() - t_hold) * 1000
                self._first_token_seen(r, d, presp, t_arrival, record, learn=not retried)
                yield first
            while True:
                try:
                    if nxt is not None:
                        fut, nxt = nxt, None
                        msg = await fut
                    else:
                        msg = await messages.__anext__()
                except StopAsyncIteration:
                    break
                if not held:  # the node cached the prompt's blocks before its first message
                    held = True
                    self.sched.prompt_held(r, d)
                if msg.joined and not msg.token_ids and not msg.finish_reason:
                    continue  # (the hold above ended with it)
                if msg.HasField("prefill"):
                    self._first_token_seen(r, d, msg.prefill, t_arrival, record)
                    resp = generate_response(
                        out_rid,
                        list(msg.token_ids),
                        decoder,
                        usage,
                        msg.prefill,
                        route,
                        req,
                        eos_ids,
                    )
                else:
                    resp = generate_response(
                        out_rid,
                        list(msg.token_ids),
                        decoder,
                        usage,
                        None,
                        None,
                        req,
                        eos_ids,
                        msg.finish_reason,
                        logprobs=list(msg.logprobs),
                        tops=list(msg.top_logprobs),
                    )
                if resp.finish_reason:
                    decoded.append(True)  # the decode node has retired it
                    yield resp
                    return
                yield resp
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise Rejected(e.code(), e.details()) from None
            raise Rejected(
                grpc.StatusCode.UNAVAILABLE,
                f"decode node {dnode.node_id} failed after "
                f"{usage.completion_tokens} tokens ({e.code().name}: {e.details()}); "
                f"retry the request",
            ) from None
        finally:
            if nxt is not None:  # (the client went away while the first token was held)
                if nxt.done() and not nxt.cancelled():
                    nxt.exception()  # (retrieved: the stream's end is no news now)
                nxt.cancel()
            stream.cancel()

    def _first_token_seen(self, r, d, presp, t_arrival, record, learn: bool = True) -> None:
        """Books the first token: the estimate's error, and (``learn``) the node's slot
        time and the TTFT for the rate and overhead models. A prefill retried on another
        node frees its booking but teaches nothing: its times belong to the node that
        served it plus a failed attempt, not to the node it was booked on."""
        ttft = (time.perf_counter() - t_arrival) * 1000
        record["actual_ttft_ms"] = ttft
        estimate, _ = d.booked()
        est = estimate.ttft_ms + r.ttft_spent_ms  # the estimate counts from admission
        METRICS.CONDUCTOR_ESTIMATE_ERROR.observe((ttft - est) / 1000)
        log.debug(
            "ttft %s route %s on %s: estimated %.1f ms (queue %.1f + node %.1f), actual "
            "%.1f ms (node queue %.1f + node %.1f), actual/estimated %.2f",
            r.request_id,
            d.route,
            estimate.node,
            est,
            estimate.queue_ms,
            estimate.prefill_ms + estimate.fetch_ms + estimate.handoff_ms,
            ttft,
            presp.queue_ms,
            presp.prefill_ms,
            ttft / est if est > 0 else float("nan"),
        )
        # compute times reach the models from the nodes' reports; here the TTFT and the
        # time the request waited for and held the node's slot, as the node measured them
        self.sched.prefill_done(
            r,
            d,
            presp.computed_tokens,
            presp.cached_tokens + presp.fetched_tokens,
            # (a request that waited for KV room: its TTFT holds how long the room took
            # to free, which says nothing of the estimates of routes and nodes)
            ttft_ms=ttft if learn and "kv_wait_ms" not in record else None,
            node_ms=presp.prefill_ms if learn and presp.prefill_ms > 0 else None,
            node_queue_ms=presp.queue_ms if learn else None,
        )

    async def cluster_status(self) -> pb.ClusterStatusResponse:
        return await cluster_status(self, self.cfg.cluster)


def main(argv: list[str] | None = None) -> None:
    cfg = load(ConductorConfig, argv, prog="kvmesh conductor", section="conductor")
    setup_logging(cfg.log_level, "conductor")
    run(lambda: Conductor(cfg))
