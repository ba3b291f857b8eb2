"""The harness of the fault suite (:mod:`kvmesh.loadtest.faults`, and the network cut of
:mod:`kvmesh.loadtest.faults_netns`): closed-loop clients whose requests have known
outputs, each request retried on retriable statuses until its deadline, and the summary
of a run around one fault (failures, hangs, recovery time). Below both suite modules, so
neither imports the other for it."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg

RETRIABLE = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
EOS = 257
TTL = 3
HANG_SLACK_S = 5.0
NODE_ARGS = [
    "--model",
    "tiny",
    "--block-size",
    "16",
    "--kv-memory",
    "16MiB",
    "--segment-memory",
    "16MiB",
    "--threads",
    "1",
]
DISAGG_ONLY = ["--colocate-below-tokens", "0", "--direct-share", "1.0"]


@dataclass
class Attempt:
    t_start: float
    t_end: float = 0.0
    code: str = "OK"
    tokens: int = 0
    detail: str = ""
    prefill: str = ""
    decode: str = ""


@dataclass
class Req:
    idx: int
    t_start: float
    deadline_s: float
    t_end: float = 0.0
    outcome: str = ""  # ok | wrong | failed (retriable, deadline) | error | hung
    attempts: list[Attempt] = field(default_factory=list)
    wrong_partial: bool = False
    last_code: str = ""
    ttft_s: float | None = None
    tbt_s: list[float] = field(default_factory=list)


async def run_request(
    stub,
    idx: int,
    prompt: list[int],
    expect: list[int],
    max_tokens: int,
    t0: float,
    deadline_s: float,
    *,
    slo: tuple[float, float] | None = None,
    retry: bool = True,
    attempt_timeout_s: float | None = None,
    salt: str = "",
) -> Req:
    """One request to its end: retries retriable statuses until ``deadline_s``."""
    start = time.perf_counter()
    req = Req(idx, start - t0, deadline_s)
    backoff = 0.1
    while True:
        left = deadline_s - (time.perf_counter() - start)
        if left <= 0.05:
            req.outcome = "failed"
            break
        att = Attempt(time.perf_counter() - t0)
        req.attempts.append(att)
        g = pb.GenerateRequest(
            token_ids=prompt,
            max_tokens=max_tokens,
            sampling=pb.SamplingParams(temperature=0.0),
            cache_salt=salt,
        )
        if slo:
            g.slo.ttft_ms, g.slo.tbt_ms = slo
        got: list[int] = []
        retry_after = 0.0
        a0, _last_t = time.perf_counter(), None
        times: list[float] = []
        try:
            call = stub.Generate(g, timeout=min(left, attempt_timeout_s or left))
            async for r in call:
                if r.HasField("route"):
                    att.prefill, att.decode = r.route.prefill_node, r.route.decode_node
                if r.token_ids:
                    now = time.perf_counter()
                    times.append(now - a0)
                    got.extend(r.token_ids)
                if r.finish_reason:
                    break
            att.code = "OK"
        except grpc.aio.AioRpcError as e:
            att.code = e.code().name
            att.detail = (e.details() or "")[:200]
            for k, v in e.trailing_metadata() or ():
                if k == "retry-after-ms":
                    try:
                        retry_after = float(v) / 1000
                    except ValueError:
                        pass
        att.t_end = time.perf_counter() - t0
        att.tokens = len(got)
        req.last_code = att.code
        if got != expect[: len(got)]:
            req.wrong_partial = True
        if att.code == "OK":
            req.outcome = "ok" if got == expect else "wrong"
            if times:
                req.ttft_s = times[0]
                req.tbt_s = [b - a for a, b in zip(times, times[1:])]
            break
        if att.code not in RETRIABLE:
            req.outcome = "error"
            break
        if not retry:
            req.outcome = "failed"
            break
        wait = retry_after if att.code == "RESOURCE_EXHAUSTED" and retry_after else backoff
        backoff = min(backoff * 2, 1.0)
        left = deadline_s - (time.perf_counter() - start)
        if wait >= left:
            req.outcome = "failed"
            break
        await asyncio.sleep(wait)
    req.t_end = time.perf_counter() - t0
    return req


class Load:
    """``concurrency`` closed-loop clients over the prompt set until stopped."""

    def __init__(
        self,
        conductor: str,
        prompts,
        expect,
        max_tokens: int,
        concurrency: int,
        deadline_s: float,
        think_s: float = 0.05,
    ) -> None:
        self.conductor, self.prompts, self.expect = conductor, prompts, expect
        self.max_tokens, self.concurrency = max_tokens, concurrency
        self.deadline_s, self.think_s = deadline_s, think_s
        self.reqs: list[Req] = []
        self.hung = 0
        self._stop = asyncio.Event()
        self.t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def _client(self, stub, k: int) -> None:
        i = k
        while not self._stop.is_set():
            idx = i % len(self.prompts)
            # every other request gets a fresh cache salt: nothing of it is cached, so it
            # takes the prefill node -> decode node route (the others hit the caches)
            salt = f"s{i}-{random.random()}" if (i // self.concurrency) % 2 == 0 else ""
            i += self.concurrency
            try:
                async with asyncio.timeout(self.deadline_s + HANG_SLACK_S):
                    r = await run_request(
                        stub,
                        idx,
                        self.prompts[idx],
                        self.expect[idx],
                        self.max_tokens,
                        self.t0,
                        self.deadline_s,
                        salt=salt,
                    )
            except TimeoutError:
                self.hung += 1
                r = Req(
                    idx,
                    self.now() - self.deadline_s - HANG_SLACK_S,
                    self.deadline_s,
                    self.now(),
                    "hung",
                )
            self.reqs.append(r)
            await asyncio.sleep(self.think_s)

    async def run(self, body) -> None:
        """Runs the clients while ``body(load)`` (a coroutine function) runs."""
        self.t0 = time.perf_counter()
        async with grpc.aio.insecure_channel(self.conductor) as ch:
            stub = pbg.ConductorStub(ch)
            clients = [asyncio.create_task(self._client(stub, k)) for k in range(self.concurrency)]
            try:
                await body(self)
            finally:
                self._stop.set()
                await asyncio.gather(*clients, return_exceptions=True)


def summarize(name: str, load: Load, t_fault: float, extra: dict) -> dict:
    reqs = load.reqs
    count = lambda o: sum(1 for r in reqs if r.outcome == o)  # noqa: E731
    atts = [a for r in reqs for a in r.attempts]
    failed_atts = [a for a in atts if a.code != "OK"]
    after = [a for a in failed_atts if a.t_end >= t_fault - 0.5]
    last_fail = max((a.t_end for a in after), default=t_fault)
    ok_after = sum(1 for a in atts if a.code == "OK" and a.t_start > last_fail)
    codes: dict[str, int] = {}
    for a in failed_atts:
        codes[a.code] = codes.get(a.code, 0) + 1
    routed: dict[str, dict[str, int]] = {}  # attempts per node before / after the fault
    for a in atts:
        for node in filter(None, (a.prefill, a.decode)):
            d = routed.setdefault(node, {"before": 0, "after": 0})
            w = "before" if a.t_start < t_fault else "after"
            if "t_heal" in extra and t_fault <= a.t_start < extra["t_heal"]:
                w = "during"
            d[w] = d.get(w, 0) + 1
    # the longest stretch after the fault with no request completing (a stall shows here
    # even when nothing fails), and the slowest attempt in flight across the fault
    ends = sorted(a.t_end for a in atts if a.code == "OK" and a.t_end >= t_fault)
    marks = [t_fault, *ends]
    gap = max((b - a for a, b in zip(marks, marks[1:])), default=0.0)
    slowest = max((a.t_end - a.t_start for a in atts if a.t_end >= t_fault), default=0.0)
    over = [r for r in reqs if r.t_end - r.t_start > r.deadline_s + 0.5 and r.outcome != "hung"]
    return {
        "fault": name,
        "requests": len(reqs),
        "completed": count("ok"),
        "retried": sum(1 for r in reqs if len(r.attempts) > 1),
        "completed_after_retry": sum(1 for r in reqs if r.outcome == "ok" and len(r.attempts) > 1),
        "failed_retriable": count("failed"),
        "failed_other": count("error"),
        "wrong": count("wrong") + sum(1 for r in reqs if r.wrong_partial and r.outcome != "wrong"),
        "hung": count("hung") + len(over),
        "failed_attempts": len(failed_atts),
        "failed_codes": codes,
        "errors": sorted(
            {a.detail for r in reqs for a in r.attempts if a.code not in RETRIABLE | {"OK"}}
        )[:5],
        "last_failure_s": round(last_fail - t_fault, 2),
        "max_gap_s": round(gap, 2),
        "slowest_attempt_s": round(slowest, 2),
        "ok_after_recovery": ok_after,
        "routed": routed,
        **extra,
    }


def live_nodes(conductor: str, reachable_only: bool = False) -> set[str]:
    """Node ids in the conductor's view (registered in etcd), or only the reachable ones."""
    try:
        with grpc.insecure_channel(conductor) as ch:
            s = pbg.ConductorStub(ch).ClusterStatus(pb.ClusterStatusRequest(), timeout=2)
        return {n.node_id for n in s.nodes if n.reachable or not reachable_only}
    except grpc.RpcError:
        return set()


def wait_for(pred, timeout: float, step: float = 0.1) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(step)
    return None


@dataclass
class Plan:
    before_s: float = 5.0  # load before the fault
    after_s: float = 12.0  # load after the fault (>= TTL + a few seconds)
    concurrency: int = 3
    max_tokens: int = 12
    deadline_s: float = 25.0


def run_fault(cluster, name: str, prompts, expect, plan: Plan, action) -> dict:
    res: dict = {}

    async def main():
        load = Load(
            cluster.conductor, prompts, expect, plan.max_tokens, plan.concurrency, plan.deadline_s
        )
        await load.run(lambda ld: action(ld, res))
        return load

    t = time.monotonic()
    load = asyncio.run(main())
    t_fault = res.pop("t_fault", 0.0)
    out = summarize(name, load, t_fault, res)
    out["duration_s"] = round(time.monotonic() - t, 1)
    out["ttl_s"] = TTL
    whole = out.get("cluster_whole_s")
    out["recovered_in_ttl_plus_5"] = (
        max(out["last_failure_s"], out["max_gap_s"]) <= TTL + 5
        and whole is not None
        and whole <= TTL + 5
    )
    return out
