"""Open-loop load driver: sends each item to a conductor's ``Generate`` at its scheduled
time (regardless of completions), records what came back.

Session items (``Item.session``) run in order within their session: turn k+1 is sent
``think_ms`` after turn k ended (or at its own scheduled time, whichever is later), and
its prompt is rebuilt from turn k's prompt + the tokens turn k *really* produced + its new
text, so the next turn starts with exactly the previous context. Sessions themselves
arrive open-loop.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import asdict, dataclass, field

import grpc

from kvmesh.loadtest.workload import Item, turn_prompt
from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg


@dataclass
class Record:
    rid: str
    scheduled_ms: float
    sent_ms: float = 0.0  # relative to the run's start
    prompt_tokens: int = 0
    max_tokens: int = 0
    status: str = "OK"  # gRPC status code name
    reject_reason: str = ""
    retry_after_ms: float = 0.0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    token_times_ms: list[float] = field(default_factory=list)  # per token, from sent
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    route: str = ""  # disaggregated | colocated (no prefill node)
    prefill_node: str = ""
    decode_node: str = ""
    estimated_ttft_ms: float = 0.0
    cached_tokens: int = 0
    computed_tokens: int = 0
    completion_tokens: int = 0
    session: str = ""
    turn: int = 0
    error: str = ""
    error_ms: float | None = None  # a failed/refused call: when its status came, from sent

    def to_json(self, with_tokens: bool = False) -> dict:
        d = asdict(self)
        if not with_tokens:
            d.pop("tokens")
        d["token_times_ms"] = [round(x, 2) for x in self.token_times_ms]
        return d


async def _one(
    stub: pbg.ConductorStub,
    it: Item,
    prompt: list[int],
    t0: float,
    timeout: float,
    slo: tuple[float, float] | None,
) -> Record:
    rec = Record(
        it.rid,
        it.t_ms,
        prompt_tokens=len(prompt),
        max_tokens=it.max_tokens,
        session=it.session,
        turn=it.turn,
    )
    req = pb.GenerateRequest(
        token_ids=prompt,
        max_tokens=it.max_tokens,
        request_id=it.rid,
        sampling=pb.SamplingParams(temperature=0.0),
    )
    if slo:
        req.slo.ttft_ms, req.slo.tbt_ms = slo
    start = time.perf_counter()
    rec.sent_ms = (start - t0) * 1000.0
    call = stub.Generate(req, timeout=timeout)
    try:
        async for r in call:
            now = (time.perf_counter() - start) * 1000.0
            if r.token_ids:
                if rec.ttft_ms is None:
                    rec.ttft_ms = now
                rec.tokens.extend(r.token_ids)
                rec.token_times_ms.extend([now] * len(r.token_ids))
            if r.HasField("route"):
                rec.prefill_node = r.route.prefill_node
                rec.decode_node = r.route.decode_node
                rec.estimated_ttft_ms = r.route.estimated_ttft_ms
                rec.route = "disaggregated" if r.route.prefill_node else "colocated"
            if r.finish_reason:
                rec.finish_reason = r.finish_reason
                rec.cached_tokens = r.usage.cached_tokens
                rec.computed_tokens = r.usage.computed_tokens
                rec.completion_tokens = r.usage.completion_tokens
        rec.e2e_ms = (time.perf_counter() - start) * 1000.0
    except grpc.aio.AioRpcError as e:
        rec.error_ms = (time.perf_counter() - start) * 1000.0
        rec.status = e.code().name
        rec.error = (e.details() or "")[:300]
        for k, v in e.trailing_metadata() or ():
            if k == "kvmesh-reject-reason":
                rec.reject_reason = v
            elif k == "retry-after-ms":
                rec.retry_after_ms = float(v)
            elif k == "kvmesh-estimated-ttft-ms":  # what admission refused it on
                rec.estimated_ttft_ms = float(v)
    return rec


async def drive(
    target: str,
    items: list[Item],
    *,
    timeout: float = 120.0,
    slo: tuple[float, float] | None = None,
    progress=None,
    use_real_outputs: bool = True,
) -> list[Record]:
    """Runs ``items`` against the conductor at ``target``; one record per item, in item
    order. ``progress`` (e.g. a tqdm bar) gets ``update(1)`` per finished request."""
    records: dict[str, Record] = {}
    async with grpc.aio.insecure_channel(
        target, options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as ch:
        stub = pbg.ConductorStub(ch)
        t0 = time.perf_counter()

        async def at(ms: float) -> None:
            delay = ms / 1000.0 - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)

        async def single(it: Item) -> None:
            await at(it.t_ms)
            records[it.rid] = await _one(stub, it, it.token_ids, t0, timeout, slo)
            if progress is not None:
                progress.update(1)

        async def session(turns: list[Item]) -> None:
            prompt: list[int] = []
            out: list[int] = []
            for k, it in enumerate(sorted(turns, key=lambda x: x.turn)):
                await at(it.t_ms)
                if k:
                    await asyncio.sleep(it.think_ms / 1000.0)
                p = (
                    turn_prompt(prompt, out, it.new_ids)
                    if (k and use_real_outputs)
                    else it.token_ids
                )
                rec = await _one(stub, it, p, t0, timeout, slo)
                records[it.rid] = rec
                if progress is not None:
                    progress.update(1)
                prompt = p
                # a rejected/failed turn: the agent continues with its planned output
                # (outputs never exceed max_tokens = the planned length, so the rebuilt
                # prompt is never longer than the planned one)
                out = rec.tokens if (rec.status == "OK" and rec.tokens) else it.planned_output

        sessions: dict[str, list[Item]] = {}
        tasks = []
        for it in items:
            if it.session:
                sessions.setdefault(it.session, []).append(it)
            else:
                tasks.append(single(it))
        tasks += [session(v) for v in sessions.values()]
        await asyncio.gather(*tasks)
    return [records[it.rid] for it in items if it.rid in records]


# -- node metrics ---------------------------------------------------------------------------
DATA_PLANE = (
    "kvmesh_transfer_bytes_total",
    "kvmesh_transfer_seconds_sum",
    "kvmesh_transfer_seconds_count",
    "kvmesh_late_hits_total",
    "kvmesh_prefill_tokens",
    "kvmesh_prefill_tokens_total",
    "kvmesh_prefill_tokens_avoided",
    "kvmesh_prefill_tokens_avoided_total",
)
# the conductor's waits for KV room and the Reserves its stale view had decode nodes refuse
KV_ROOM = ("kvmesh_kv_waits_total", "kvmesh_reserves_refused_total")


def scrape(
    addresses: list[str], timeout: float = 3.0, want: tuple[str, ...] = DATA_PLANE
) -> dict[str, float]:
    """Sums the ``want`` samples over the given /metrics endpoints (by default the data
    plane's: transfer bytes and seconds by path, late hits by reason, prefill tokens by
    kind)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for addr in addresses:
        try:
            with urllib.request.urlopen(f"http://{addr}/metrics", timeout=timeout) as r:
                text = r.read().decode()
        except OSError:
            continue
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name not in want:
                    continue
                label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "node")
                key = f"{s.name}{{{label}}}" if label else s.name
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}
