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
     (``prefilling``; the node's predicted time counts in its queue meanwhile); the first
     token goes to the client at once;
  6. ``Decode`` on the decode node; tokens are relayed as they come (``decoding``); the
     last message carries finish_reason and usage.
A node that fails before the first token is skipped for the next candidate; one that
fails afterwards ends the stream with UNAVAILABLE (the client retries).
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from protos import kvmesh_pb2 as pb
from protos import kvmesh_pb2_grpc as pbg
from services.common.config import ConfigError, load, option
from services.common.hashing import prefix_hashes
from services.common.registry import Membership, nodes_prefix
from services.common.service import Service, run, setup_logging
from services.common.settings import ServiceConfig
from services.conductor.cluster import ClusterView, NodeInfo
from services.conductor.estimator import NodeEstimate, PrefillCost, estimate
from services.engine.sampling import Sampling
from services.engine.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)


@dataclass
class ConductorConfig(ServiceConfig):
    """conductor: client API, cache-aware routing and early rejection."""

    ttft_slo_ms: float = option(60000.0, "cluster TTFT SLO in ms; requests may only tighten it")
    tbt_slo_ms: float = option(5000.0, "cluster time-between-tokens SLO in ms")
    prefill_base_ms: float = option(5.0, "prefill regression: fixed cost per request (ms)")
    prefill_token_ms: float = option(0.05, "prefill regression: cost per new token (ms)")
    prefill_pair_ms: float = option(1e-6, "prefill regression: cost per (new x all) token pair (ms)")
    bandwidth_gbps: float = option(1.0, "assumed data-plane bandwidth for fetch and handoff (GB/s)")
    request_timeout_s: float = option(300.0, "longest a request may run end to end")

    def validate(self) -> None:
        super().validate()
        if self.ttft_slo_ms <= 0 or self.tbt_slo_ms <= 0:
            raise ConfigError("ttft_slo_ms and tbt_slo_ms must be > 0")
        if self.bandwidth_gbps <= 0:
            raise ConfigError("bandwidth_gbps must be > 0")


class Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code, self.message, self.metadata = code, message, metadata


class ConductorServicer(pbg.ConductorServicer):
    def __init__(self, c: "Conductor") -> None:
        self.c = c

    async def Generate(self, req, context):
        try:
            async for resp in self.c.generate(req):
                yield resp
        except Rejected as e:
            if e.metadata:
                context.set_trailing_metadata(e.metadata)
            await context.abort(e.code, e.message)

    async def ClusterStatus(self, req, context):
        return await self.c.cluster_status()


class Conductor(Service):
    role = "conductor"

    def __init__(self, cfg: ConductorConfig) -> None:
        super().__init__(cfg)
        self.cfg: ConductorConfig = cfg
        self.membership = Membership(self.etcd, nodes_prefix(cfg.cluster))
        self.view = ClusterView(self.membership)
        self.cost = PrefillCost(cfg.prefill_base_ms, cfg.prefill_token_ms, cfg.prefill_pair_ms)
        self.estimates: dict[str, NodeEstimate] = {}
        self.decode_load: dict[str, int] = {}
        self.tokenizer = ByteTokenizer()

    async def setup(self) -> None:
        pbg.add_ConductorServicer_to_server(ConductorServicer(self), self.server)
        await self.membership.start()

    async def teardown(self) -> None:
        await self.membership.stop()
        await self.view.close()

    # -- admission -----------------------------------------------------------------------
    def _resolve_model(self, name: str) -> tuple[str, str]:
        models = self.view.models()
        if not models:
            raise Rejected(grpc.StatusCode.UNAVAILABLE,
                           "no model is served yet: the cluster has no prefill+decode node pair")
        if not name:
            if len(models) > 1:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                               f"model is required: this cluster serves {sorted(models)}")
            name = next(iter(models))
        if name not in models:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"unknown model {name!r}; this cluster serves {sorted(models)}")
        return name, models[name][0]

    def _tokens(self, req: pb.GenerateRequest, info: dict) -> list[int]:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if req.token_ids:
            tokens = list(req.token_ids)
            vocab = int(info.get("vocab_size", 0))
            if any(t < 0 or t >= vocab for t in tokens):
                raise Rejected(bad, f"token_ids must be in [0, {vocab}) for this model")
        else:
            tokens = self.tokenizer.encode(req.prompt) if req.prompt else []
        if not tokens or (not req.token_ids and not req.prompt.strip()):
            raise Rejected(bad, "the prompt is empty: give prompt text or token_ids")
        if req.max_tokens <= 0:
            raise Rejected(bad, f"max_tokens must be > 0, got {req.max_tokens}")
        ctx = int(info.get("max_context", 0))
        if len(tokens) + req.max_tokens > ctx:
            raise Rejected(bad, f"the prompt has {len(tokens)} tokens and max_tokens is "
                                f"{req.max_tokens}: together they exceed the model's context "
                                f"of {ctx} tokens; shorten the prompt or lower max_tokens")
        err = Sampling.from_proto(req.sampling).validate(int(info.get("vocab_size", 0)))
        if err:
            raise Rejected(bad, err)
        if req.slo.ttft_ms < 0 or req.slo.tbt_ms < 0:
            raise Rejected(bad, "slo values must be >= 0 (0 = the cluster default)")
        return tokens

    async def _store_prefix(self, hashes: list[bytes]) -> int:
        stub = self.view.store_stub()
        if not hashes or stub is None:
            return 0
        try:
            resp = await stub.Exists(pb.ExistsRequest(hashes=hashes), timeout=1)
            return resp.prefix_blocks
        except grpc.aio.AioRpcError:
            return 0

    # -- the request's life --------------------------------------------------------------
    async def generate(self, req: pb.GenerateRequest):
        model, fp = self._resolve_model(req.model)
        prefills = [n for n in self.view.nodes("prefill") if n.fingerprint == fp]
        decodes = [n for n in self.view.nodes("decode") if n.fingerprint == fp]
        info = prefills[0].raw
        tokens = self._tokens(req, info)
        rid = req.request_id or uuid.uuid4().hex
        bs = int(info["block_size"])
        seed = bytes.fromhex(fp) + req.cache_salt.encode()
        hashes = prefix_hashes(seed, tokens, bs)
        slo = self.cfg.ttft_slo_ms if req.slo.ttft_ms <= 0 else min(req.slo.ttft_ms,
                                                                        self.cfg.ttft_slo_ms)
        store_prefix = await self._store_prefix(hashes)
        bw = self.cfg.bandwidth_gbps * 1e6  # bytes per ms
        ests = []
        for n in prefills:
            view = self.estimates.setdefault(n.node_id, NodeEstimate())
            ests.append((estimate(n.node_id, view, self.cost, len(tokens), bs, hashes,
                                  store_prefix, int(n.raw["block_nbytes"]),
                                  int(n.raw["layer_nbytes"]), bw), n))
        ests.sort(key=lambda e: e[0].ttft_ms)
        if not ests or not decodes:
            raise Rejected(grpc.StatusCode.UNAVAILABLE,
                           f"model {model!r} has no live prefill or decode node; retry shortly")
        best = ests[0][0]
        if best.ttft_ms > slo:
            retry_ms = max(best.queue_ms, 100.0)
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"estimated TTFT {best.ttft_ms:.1f} ms (queue {best.queue_ms:.1f} + "
                           f"prefill {best.prefill_ms:.1f} + fetch {best.fetch_ms:.1f} + handoff "
                           f"{best.handoff_ms:.1f}) on the best node {best.node_id} exceeds the "
                           f"TTFT SLO of {slo:.1f} ms; retry after {retry_ms:.0f} ms",
                           (("retry-after-ms", f"{retry_ms:.0f}"),
                            ("kvmesh-estimated-ttft-ms", f"{best.ttft_ms:.1f}")))

        target, dnode = await self._reserve(rid, len(tokens), req.max_tokens, decodes)
        try:
            first, pnode, presp, est = await self._prefill(rid, tokens, hashes, target, req, ests)
        except BaseException:
            await self._release(dnode, rid)
            raise
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        usage = pb.Usage(prompt_tokens=len(tokens), completion_tokens=1,
                         cached_tokens=presp.cached_tokens + presp.fetched_tokens,
                         computed_tokens=presp.computed_tokens)
        eos = self.tokenizer.eos_id
        done = (first == eos and not req.sampling.ignore_eos) or req.max_tokens == 1
        reason = ("stop" if first == eos and not req.sampling.ignore_eos else "length") if done else ""
        yield pb.GenerateResponse(
            request_id=rid, token_ids=[first], text=decoder.decode(self._bytes(first)),
            finish_reason=reason, usage=usage if done else None,
            route=pb.Route(prefill_node=pnode.node_id, decode_node=dnode.node_id,
                           estimated_ttft_ms=est))
        if done:
            await self._release(dnode, rid)
            return
        self.decode_load[dnode.node_id] = self.decode_load.get(dnode.node_id, 0) + 1
        stream = None
        try:
            stream = self.view.decode_stub(dnode).Decode(pb.DecodeRequest(
                request_id=rid, first_token=first, max_tokens=req.max_tokens,
                sampling=req.sampling), timeout=self.cfg.request_timeout_s)
            async for d in stream:
                usage.completion_tokens += len(d.token_ids)
                text = "".join(decoder.decode(self._bytes(t)) for t in d.token_ids)
                if d.finish_reason:
                    text += decoder.decode(b"", final=True)
                yield pb.GenerateResponse(request_id=rid, token_ids=d.token_ids, text=text,
                                          finish_reason=d.finish_reason,
                                          usage=usage if d.finish_reason else None)
        except grpc.aio.AioRpcError as e:
            raise Rejected(grpc.StatusCode.UNAVAILABLE,
                           f"decode node {dnode.node_id} failed after "
                           f"{usage.completion_tokens} tokens ({e.code().name}: {e.details()}); "
                           f"retry the request") from None
        finally:
            self.decode_load[dnode.node_id] -= 1
            if stream is not None:
                stream.cancel()

    def _bytes(self, token: int) -> bytes:
        return bytes([token]) if token < 256 else b""

    async def _reserve(self, rid: str, n: int, max_tokens: int, decodes: list[NodeInfo]):
        order = sorted(decodes, key=lambda d: self.decode_load.get(d.node_id, 0))
        last = ""
        for d in order:
            try:
                resp = await self.view.decode_stub(d).Reserve(
                    pb.ReserveRequest(request_id=rid, prompt_tokens=n, max_tokens=max_tokens),
                    timeout=5)
                return resp.target, d
            except grpc.aio.AioRpcError as e:
                last = f"{d.node_id}: {e.code().name} {e.details()}"
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise Rejected(e.code(), e.details()) from None
        raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"no decode node could reserve KV for {n + max_tokens} tokens "
                       f"(last: {last}); retry later")

    async def _release(self, d: NodeInfo, rid: str) -> None:
        try:
            await self.view.decode_stub(d).Release(pb.ReleaseRequest(request_id=rid), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.warning("releasing %s on %s failed: %s", rid, d.node_id, e.code())

    async def _prefill(self, rid, tokens, hashes, target, req, ests):
        last = ""
        for est, node in ests[:3]:
            view = self.estimates[node.node_id]
            predicted = est.prefill_ms
            view.inflight_ms += predicted
            t0 = time.perf_counter()
            try:
                resp = await self.view.prefill_stub(node).Prefill(pb.PrefillRequest(
                    request_id=rid, token_ids=tokens, block_hashes=hashes, target=target,
                    sampling=req.sampling), timeout=self.cfg.request_timeout_s)
            except grpc.aio.AioRpcError as e:
                last = f"{node.node_id}: {e.code().name} {e.details()}"
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise Rejected(e.code(), e.details()) from None
                log.warning("prefill on %s failed (%s); trying the next node", node.node_id, last)
                continue
            finally:
                view.inflight_ms -= predicted
            view.observe(predicted / view.correction, resp.prefill_ms)
            view.cached_hashes.update(hashes)
            log.debug("prefill %s on %s: %.1f ms (predicted %.1f)", rid, node.node_id,
                      (time.perf_counter() - t0) * 1000, predicted)
            return resp.first_token, node, resp, est.ttft_ms
        raise Rejected(grpc.StatusCode.UNAVAILABLE, f"prefill failed on every candidate "
                                                    f"(last: {last}); retry the request")

    # -- status --------------------------------------------------------------------------
    async def cluster_status(self) -> pb.ClusterStatusResponse:
        out = pb.ClusterStatusResponse(cluster=self.cfg.cluster)
        nodes = self.view.nodes()

        async def one(n: NodeInfo) -> pb.NodeStatus:
            base = pb.NodeStatus(node_id=n.node_id, role=n.role, grpc_address=n.grpc,
                                 data_address=n.raw.get("data", ""), model=n.model,
                                 fingerprint=n.fingerprint, reachable=True)
            stub = (self.view.prefill_stub(n) if n.role == "prefill" else
                    self.view.decode_stub(n) if n.role == "decode" else None)
            if stub is None:
                return base
            try:
                return await stub.Status(pb.NodeStatusRequest(), timeout=1)
            except grpc.aio.AioRpcError:
                base.reachable = False
                return base

        out.nodes.extend(await asyncio.gather(*(one(n) for n in nodes)))
        stub = self.view.store_stub()
        if stub is not None:
            try:
                s = await stub.Stats(pb.StoreStatsRequest(), timeout=1)
                out.store_blocks, out.store_bytes_used, out.store_bytes_total = (
                    s.blocks, s.bytes_used, s.bytes_total)
            except grpc.aio.AioRpcError:
                pass
        return out


def main(argv: list[str] | None = None) -> None:
    cfg = load(ConductorConfig, argv, prog="kvmesh conductor", section="conductor")
    setup_logging(cfg.log_level, "conductor")
    run(lambda: Conductor(cfg))
