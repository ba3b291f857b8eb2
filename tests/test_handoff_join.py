"""The hand-off is a TBT, not a TTFT (issue 31): a request's second
token must follow its first within the TBT SLO, bursts included.

With a fake model (no processes): the decode node's BatchScheduler lets the batch step
between any two chunks of the prompts it computes, however many are queued; a request
admitted while a chunk runs, or whose prompt just ended here, is in the very next step,
before the next chunk of a queued prompt; a ``join_signal`` request hears
``JOINED`` as the step computing its next token begins, before that token; chunks are
sized by time (``ChunkClock``) to leave the running requests' TBT SLOs room.

Through a real cluster (etcd, separate processes, the tiny model): a burst of concurrent
requests on both routes gets exactly the single-process reference's tokens, and every
request's first token reached the client only after its decode node had begun the step
that computes its second (the decode node's ``decode.join`` span ended before the client
saw the first token; both clocks are this machine's, and each event causes the next, so
the order holds however loaded the machine is). The gap's size is
``loadtest/bench_handoff.py``'s to measure, not a timed test's.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from kvmesh.services.common.sampling_params import Sampling
from kvmesh.services.decode.batch import JOINED, BatchScheduler, ChunkClock, Reservation, Running
from kvmesh.services.engine.config import ModelConfig
from kvmesh.services.engine.kv_pool import KVPool

BS = 4
VOCAB = 64
CFG = ModelConfig(
    vocab_size=VOCAB,
    hidden_size=4,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    head_dim=2,
    intermediate_size=4,
    max_position_embeddings=512,
)


def one_hot(token: int) -> torch.Tensor:
    logits = torch.zeros(VOCAB)
    logits[(token + 1) % VOCAB] = 1.0
    return logits


class SlowModel:
    """Logs every forward in order (``("prefill", first token id, n)`` or ``("decode",
    first token ids)``); a prefill takes ``prefill_s`` in its worker thread."""

    def __init__(self, prefill_s: float = 0.01) -> None:
        self.prefill_s = prefill_s
        self.calls: list[tuple] = []
        self.lock = threading.Lock()

    def forward_prefill(self, token_ids, start_pos, pool, table, on_layer_done=None):
        ids = token_ids.tolist()
        time.sleep(self.prefill_s)
        with self.lock:
            self.calls.append(("prefill", ids[0], len(ids)))
        return one_hot(ids[-1])

    def forward_decode(self, token_ids, positions, tables, pool, mirror=None, keys=None):
        ids = token_ids.tolist()
        with self.lock:
            self.calls.append(("decode", tuple(ids)))
        return torch.stack([one_hot(t) for t in ids])


def scheduler(
    model, budget: int = 64, chunk_ms: float = 0.0, profile=None, tbt_share: float = 0.0
) -> BatchScheduler:
    return BatchScheduler(
        model,
        KVPool(CFG, 256, BS),
        BS,
        8,
        budget,
        frozenset(),
        lambda *a: None,
        lambda *a: None,
        {"generated": 0},
        prefill_chunk=8,  # a prompt of 24 tokens is 3 chunks
        chunk_ms=chunk_ms,
        profile=profile,
        tbt_share=tbt_share,
    )


async def start(s: BatchScheduler, rid: str, prompt: list[int], max_tokens: int, join=False):
    res = Reservation(rid, len(prompt), s.pool.allocate(len(prompt) // BS + 1))
    res.prompt_ids = list(prompt)
    logits = await s.compute_prompt(prompt, 0, res.blocks)
    res.kv_ready.set()
    first = int(logits.argmax())
    res.generated = [first]
    return Running(
        res,
        first,
        len(prompt),
        max_tokens - 1,
        1,
        Sampling(ignore_eos=True),
        frozenset(),
        join_signal=join,
    )


async def collect(s: BatchScheduler, r: Running) -> list:
    out: list = []
    try:
        while True:
            item = await r.out.get()
            if isinstance(item, BaseException):
                raise item
            out.append(item if item is JOINED else item[0])
            if item is not JOINED and item[1]:
                return out
    finally:
        s.leave(r)
        s.free(r.res)


async def test_the_batch_steps_between_any_two_chunks_however_many_prompts_wait():
    """A request decodes while five prompts of three chunks each are computed here, all
    sent at once: no two prompt chunks run back to back while it is in the batch (with
    one FIFO for every chunk, its steps waited for all fifteen), and the prompts are
    computed one after the other, each whole before the next starts."""
    model = SlowModel(prefill_s=0.01)
    s = scheduler(model)
    loop = asyncio.create_task(s.run())
    try:
        a = await start(s, "a", [1, 2, 3], max_tokens=40)
        s.admit(a)
        reader = asyncio.create_task(collect(s, a))
        prompts = [[10 * (k + 1)] + [5] * 23 for k in range(5)]  # 24 tokens: 3 chunks each
        await asyncio.gather(*(s.compute_prompt(p, 0, s.pool.allocate(7)) for p in prompts))
        await reader
    finally:
        loop.cancel()
    calls = model.calls[1:]  # (a's own prompt first)
    chunks = [i for i, c in enumerate(calls) if c[0] == "prefill"]
    assert len(chunks) == 15
    last_decode = max(i for i, c in enumerate(calls) if c[0] == "decode")
    for i, j in zip(chunks, chunks[1:]):
        if j < last_decode:
            assert j > i + 1, f"chunks {i} and {j} back to back while a decodes: {calls}"
    firsts = [c[1] for c in calls if c[0] == "prefill" and c[1] != 5]
    starts = [c[1] for c in calls if c[0] == "prefill"]
    assert firsts == [10, 20, 30, 40, 50]  # FIFO, whole prompts: 10 5 5 20 5 5 ...
    assert starts == [x for k in range(1, 6) for x in (10 * k, 5, 5)]


async def test_a_request_admitted_while_a_chunk_runs_is_in_the_next_step_and_hears_joined_first():
    """``b`` joins while a prompt's chunk holds the compute and the batch's next step waits
    for it: that very step holds b (its batch is taken as it starts), b's queue gets
    JOINED as it begins, then b's token; a request without join_signal gets no JOINED."""
    gate, started = threading.Event(), threading.Event()

    class Gated(SlowModel):
        def forward_prefill(self, token_ids, start_pos, pool, table, on_layer_done=None):
            if token_ids.tolist()[0] == 99:
                started.set()
                gate.wait(10)
            return super().forward_prefill(token_ids, start_pos, pool, table)

    model = Gated(prefill_s=0.0)
    s = scheduler(model)
    loop = asyncio.create_task(s.run())
    try:
        a = await start(s, "a", [1, 2, 3], max_tokens=30)
        b = await start(s, "b", [20, 21, 22], max_tokens=3, join=True)
        s.admit(a)
        reader_a = asyncio.create_task(collect(s, a))
        slow = asyncio.create_task(s.compute_prompt([99] * 8, 0, s.pool.allocate(3)))
        while not started.is_set():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)  # the batch loop now waits for the compute
        s.admit(b)
        n_before = len(model.calls)
        gate.set()
        out_b = await collect(s, b)
        await slow
        out_a = await reader_a
    finally:
        gate.set()
        loop.cancel()
    assert out_b == [JOINED, 24, 25]
    assert JOINED not in out_a and len(out_a) == 29
    after = model.calls[n_before:]
    assert after[0] == ("prefill", 99, 8)
    assert after[1][0] == "decode" and 23 in after[1][1], after[:3]  # b's first step


async def test_a_prompt_that_ends_here_joins_a_step_before_the_next_prompts_chunk():
    """Two prompts computed here, sent at once, nothing decoding yet: the first one's
    request is in a step before the second prompt's first chunk runs (its first token is
    held until that step, so the hold is one step, not a chunk and a step)."""
    model = SlowModel(prefill_s=0.01)
    s = scheduler(model)
    loop = asyncio.create_task(s.run())

    async def colocated(rid: str, prompt: list[int]) -> list:
        r = await start(s, rid, prompt, max_tokens=3, join=True)
        s.admit(r)  # (as the Decode call does, as soon as its prompt is computed)
        return await collect(s, r)

    try:
        p, q = await asyncio.gather(colocated("p", [10] + [5] * 7), colocated("q", [20] + [5] * 7))
    finally:
        loop.cancel()
    assert p[0] is JOINED and q[0] is JOINED
    assert model.calls[:3] == [("prefill", 10, 8), ("decode", (6,)), ("prefill", 20, 8)]


async def test_a_preempted_request_that_never_stepped_hears_joined_so_its_hold_ends():
    model = SlowModel(prefill_s=0.0)
    s = scheduler(model)
    r = await start(s, "r", [1, 2, 3], max_tokens=4, join=True)
    s.running.append(r)
    s._preempt(r)
    assert r.out.get_nowait() is JOINED and r.joined
    r.signal_join()  # once only
    assert r.out.empty()


def test_the_chunk_clock_sizes_chunks_by_time():
    # 1 ms per token at no context, + 0.001 ms per token of context
    pts = [[n, c, n * (1.0 + 0.001 * (c + n / 2))] for n in (16, 64, 256) for c in (0, 256)]
    clock = ChunkClock(pts)
    assert clock.a == pytest.approx(1.0, rel=1e-6) and clock.b == pytest.approx(0.001, rel=1e-6)
    n = clock.tokens(0, 512, 16, 50.0)
    assert n % 16 == 0 and clock.ms(n, 0) <= 50.0 < clock.ms(n + 16, 0)
    later = clock.tokens(2000, 512, 16, 50.0)  # longer context: fewer tokens, same time
    assert 16 <= later < n and clock.ms(later, 2000) <= 50.0
    assert clock.tokens(0, 32, 16, 50.0) == 32  # never above what the token budget allows
    assert clock.tokens(0, 512, 16, float("inf")) == 512  # no bound
    assert clock.tokens(0, 512, 16, -5.0) == 16  # no time left: one block
    assert ChunkClock().tokens(0, 512, 16, 50.0) == 512  # unmeasured: by tokens until...
    fresh = ChunkClock()
    fresh.observe(100, 0, 200.0)  # ... the first chunk: 2 ms per token
    assert fresh.tokens(0, 512, 16, 50.0) == 16
    # twice as slow as modelled, repeatedly (a loaded machine): chunks shrink to match
    for _ in range(20):
        clock.observe(n, 0, 2 * clock.ms(n, 0) / clock.factor)
    assert clock.factor == pytest.approx(2.0, rel=0.01)
    assert clock.ms(clock.tokens(0, 512, 16, 50.0), 0) <= 50.0
    assert clock.tokens(0, 512, 16, 50.0) <= n // 2 + 16
    # a forward's own cost (5 ms here) is fitted apart: a small chunk is not taken for a
    # slow one, and the time left after it is what the tokens get
    pts = [[n, c, 5.0 + n * (1.0 + 0.001 * (c + n / 2))] for n in (16, 64, 256) for c in (0, 256)]
    clock = ChunkClock(pts)
    assert clock.c0 == pytest.approx(5.0, abs=1e-6) and clock.a == pytest.approx(1.0, rel=1e-6)
    assert clock.tokens(0, 512, 16, 50.0) == 32  # 5 + 32 x 1.016 <= 50 < 5 + 48 x 1.024
    assert clock.tokens(0, 512, 16, 4.0) == 16  # less than a forward's cost: one block
    clock.observe(2, 0, 5.0 + 2 * 1.001)
    assert clock.factor == pytest.approx(1.0, rel=1e-3)
    # a context term fitted as next to nothing (least squares on a flat profile gave
    # b = 1.7e-18 about one run in three): the same chunk as with none, not the whole
    # prompt (the textbook root's -lin + sqrt(lin^2 + ...) cancelled to noise)
    for b in (0.0, 1.7e-18):
        clock = ChunkClock()
        clock.a, clock.b = 1.0 - 1e-16, b
        assert clock.tokens(0, 511, 4, 20.0) == 20, b


async def test_prompt_chunks_here_leave_the_running_requests_tbt_slo_room():
    """While a request with a TBT SLO of 40 ms decodes, a long prompt computed here is cut
    into chunks of the SLO's share (0.5: 20 ms, 20 tokens at the profile's 1 ms per token)
    less the last step's time, or of ``chunk_ms`` where that is tighter; with nothing
    decoding it is one chunk (by the token budget alone: no one waits on it)."""
    pts = [[n, 0, n * 1.0] for n in (16, 64, 256)]  # 1 ms per token

    async def first_chunk(chunk_ms: float, slo: float | None, step_ms: float = 0.0) -> int:
        model = SlowModel(prefill_s=0.0)
        s = scheduler(model, budget=512, chunk_ms=chunk_ms, profile=pts, tbt_share=0.5)
        s.prefill_chunk, s.step_ms = 512, step_ms
        if slo is not None:
            r = await start(s, "r", [1, 2, 3], max_tokens=4)
            r.tbt_slo_ms, r.joined = slo, True  # (decoding; no step runs in this test)
            s.running.append(r)
            model.calls.clear()
            s.clock.factor = 1.0  # (its own prompt, computed at once, taught it nothing)
        await s.compute_prompt(list(range(1, 61)), 0, s.pool.allocate(16))
        return model.calls[0][2]

    assert await first_chunk(0.0, 40.0) == 20
    assert await first_chunk(0.0, 40.0, step_ms=8.0) == 12  # 20 ms less an 8 ms step
    assert await first_chunk(12.0, 40.0) == 12  # the fixed bound is tighter
    assert await first_chunk(0.0, 0.0) == 60  # no SLO given, no fixed bound: by tokens
    assert await first_chunk(12.0, None) == 60  # nothing decoding: by tokens


# -- through a real cluster ------------------------------------------------------------------

BURST = 12
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def traced_cluster(tmp_path_factory):
    from kvmesh.services.launcher import LocalCluster
    from tests.cluster_util import NODE_ARGS

    root = tmp_path_factory.mktemp("handoff")
    traces = root / "traces"
    traces.mkdir()
    mp = pytest.MonkeyPatch()
    mp.setenv("KVMESH_TRACE_FILE", str(traces) + "/")
    mp.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    # the defaults otherwise: prompts under 512 tokens are computed by the decode node
    # itself (colocated), longer ones handed off by the prefill node
    cluster = LocalCluster(str(root / "cluster"), node_args=NODE_ARGS, http_port=-1)
    try:
        cluster.start()
        yield cluster, str(traces)
    finally:
        cluster.stop()
        mp.undo()


async def _burst(address: str, prompts: list[list[int]]) -> list[dict]:
    """Sends every prompt at once; per request its tokens, route and the wall clock
    (``time.time_ns``) at which its first token arrived."""
    import grpc

    from kvmesh.protos import kvmesh_pb2 as pb
    from kvmesh.protos import kvmesh_pb2_grpc as pbg

    async def one(stub, i: int, prompt: list[int]) -> dict:
        out: dict = {"rid": f"burst-{i}", "tokens": [], "first_ns": None, "route": ""}
        req = pb.GenerateRequest(
            token_ids=prompt,
            max_tokens=MAX_TOKENS,
            request_id=out["rid"],
            sampling=pb.SamplingParams(temperature=0.0),
        )
        async for resp in stub.Generate(req, timeout=120):
            if resp.token_ids and out["first_ns"] is None:
                out["first_ns"] = time.time_ns()
            out["tokens"].extend(resp.token_ids)
            if resp.HasField("route"):
                out["route"] = "disaggregated" if resp.route.prefill_node else "colocated"
        return out

    async with grpc.aio.insecure_channel(address) as ch:
        stub = pbg.ConductorStub(ch)
        return await asyncio.gather(*(one(stub, i, p) for i, p in enumerate(prompts)))


def _join_span(traces: str, rid: str, timeout: float = 30) -> dict:
    """The ``decode.join`` span of the request whose Generate span carries ``rid``."""
    from kvmesh.services.common.telemetry import read_spans

    deadline = time.monotonic() + timeout
    while True:
        spans = read_spans(traces)
        roots = [
            s
            for s in spans
            if s["name"] == "kvmesh.v1.Conductor/Generate"
            and s["attributes"].get("kvmesh.request_id") == rid
        ]
        joins = [
            s
            for s in spans
            if roots and s["trace_id"] == roots[0]["trace_id"] and s["name"] == "decode.join"
        ]
        if joins or time.monotonic() > deadline:
            assert len(joins) == 1, (rid, len(roots), len(joins))
            return joins[0]
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_a_burst_gets_every_first_token_only_once_its_decode_node_stepped_it(traced_cluster):
    import random

    from kvmesh.services.common.tokenizer import ByteTokenizer
    from kvmesh.services.engine.model import LlamaModel

    cluster, traces = traced_cluster
    rng = random.Random(31)
    # half short (colocated), half long (disaggregated), sent at once
    lengths = [rng.randint(60, 400) if i % 2 else rng.randint(520, 720) for i in range(BURST)]
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]
    got = asyncio.run(_burst(cluster.conductor, prompts))
    assert {g["route"] for g in got} == {"colocated", "disaggregated"}, [g["route"] for g in got]

    # exactly the tokens of the model computing everything from scratch in one process
    model = LlamaModel.from_preset("tiny", seed=0)
    eos = ByteTokenizer().eos_id
    for g, p in zip(got, prompts):
        assert g["tokens"] == model.reference_generate(p, MAX_TOKENS, eos_id=eos), g["rid"]

    # each first token reached the client only after its decode node began the step that
    # computes the second (the span ends there; the node's message of it causes the
    # first token's release): the gap to the second token is that one step
    for g in got:
        join = _join_span(traces, g["rid"])
        assert join["attributes"]["kvmesh.prefill_here"] == (g["route"] == "colocated")
        assert join["end_ns"] <= g["first_ns"], (g["rid"], g["route"], join, g["first_ns"])
