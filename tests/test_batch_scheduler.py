"""The decode node's BatchScheduler with a fake model (no processes, tiny tensors):
admission into the running batch, KV growth one block at a time, preemption of the
youngest request when the pool runs out, and the recompute of preempted requests (in
the order they were preempted, from what the prefix cache still holds) with every
output token unchanged and no block left behind."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvmesh.services.common.hashing import prefix_hashes
from kvmesh.services.common.sampling_params import Sampling
from kvmesh.services.decode.batch import BatchScheduler, Reservation, Running
from kvmesh.services.engine.config import ModelConfig
from kvmesh.services.engine.kv_pool import KVPool

pytestmark = pytest.mark.timeout(30)

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
    max_position_embeddings=256,
)
SEED = b"batch-test"


def one_hot(token: int) -> torch.Tensor:
    """Logits whose greedy choice is ``token + 1``: outputs are easy to predict."""
    logits = torch.zeros(VOCAB)
    logits[(token + 1) % VOCAB] = 1.0
    return logits


class FakeModel:
    """Records every call; checks that each position it writes has a block of its own
    (a failed check fails the step, so the request's stream ends with the error)."""

    def __init__(self) -> None:
        self.prefills: list[tuple[list[int], int]] = []
        self.decodes: list[list[tuple[int, int, int]]] = []  # (token, position, blocks)

    def forward_prefill(self, token_ids, start_pos, pool, table, on_layer_done=None):
        ids = token_ids.tolist()
        assert len(table) * BS >= start_pos + len(ids)
        self.prefills.append((ids, start_pos))
        return one_hot(ids[-1])

    def forward_decode(self, token_ids, positions, tables, pool, mirror=None, keys=None):
        self.decodes.append(
            [(t, p, len(tb)) for t, p, tb in zip(token_ids.tolist(), positions, tables)]
        )
        written = [tb[p // BS] for p, tb in zip(positions, tables)]  # IndexError: no block
        assert len(set(written)) == len(written), "two requests write one block"
        return torch.stack([one_hot(t) for t in token_ids.tolist()])


class Harness:
    """A scheduler over a pool of ``num_blocks``, and what the Decode RPC does around it."""

    def __init__(self, num_blocks: int, max_batch: int = 8) -> None:
        self.pool = KVPool(CFG, num_blocks, BS)
        self.model = FakeModel()
        self.sched = BatchScheduler(
            self.model,
            self.pool,
            BS,
            max_batch,
            step_token_budget=64,
            eos_ids=frozenset(),
            on_step=lambda *a: None,
            on_prompt=lambda *a: None,
            counters={"generated": 0},
        )
        self.loop: asyncio.Task | None = None

    async def start(self, rid: str, prompt: list[int], max_tokens: int) -> Running:
        """Reserve (prompt blocks + one), compute the prompt here, build the Running."""
        res = Reservation(rid, len(prompt), self.pool.allocate(len(prompt) // BS + 1))
        res.prompt_ids = list(prompt)
        res.hashes = prefix_hashes(SEED, prompt, BS)
        logits = await self.sched.compute_prompt(prompt, 0, res.blocks)
        res.kv_ready.set()
        first = int(logits.argmax())
        res.generated = [first]
        return Running(
            res, first, len(prompt), max_tokens - 1, 1, Sampling(ignore_eos=True), frozenset()
        )

    async def collect(self, r: Running) -> list[int] | BaseException:
        """Reads a request's tokens to its end, then leaves and frees like ``retire``."""
        out = [r.token]
        try:
            while True:
                item = await r.out.get()
                if isinstance(item, BaseException):
                    return item
                tok, reason, _ = item
                out.append(tok)
                if reason:
                    return out
        finally:
            self.sched.leave(r)
            self.sched.free(r.res)

    def run(self) -> None:
        self.loop = asyncio.create_task(self.sched.run())

    async def stop(self) -> None:
        self.loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.loop


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    return [(prompt[-1] + 1 + i) % VOCAB for i in range(max_tokens)]


def positions_of(model: FakeModel, first_token: int) -> list[tuple[int, int]]:
    """(position, blocks held) of each decode step of the request whose tokens follow
    ``first_token`` (token ranges of the tests' requests do not overlap)."""
    return [
        (p, n) for step in model.decodes for t, p, n in step if first_token <= t < first_token + 20
    ]


async def test_an_admitted_request_grows_one_block_at_a_time_and_frees_all():
    h = Harness(num_blocks=8)
    prompt = [0, 1, 2, 3, 4, 5]
    r = await h.start("a", prompt, max_tokens=12)
    assert len(r.res.blocks) == 2  # the prompt and the first generated token
    h.run()
    h.sched.admit(r)
    out = await h.collect(r)
    await h.stop()
    assert out == expected(prompt, 12)
    steps = positions_of(h.model, 6)
    assert [p for p, _ in steps] == list(range(6, 17))
    # exactly the blocks the position needs: one more at each block boundary, never ahead
    assert all(n == p // BS + 1 for p, n in steps), steps
    assert h.pool.num_used == 0  # the full blocks stay cached, evictable
    assert h.pool.num_free == h.pool.num_blocks
    assert h.sched.preemptions == 0


async def test_out_of_blocks_preempts_the_youngest_not_the_one_growing():
    """The oldest request needs a block first; the youngest is the one preempted, and
    is recomputed later from its cached prompt block with every token unchanged."""
    h = Harness(num_blocks=3)
    pa, pb = [0, 1, 2], [10, 11, 12, 13, 14]
    a = await h.start("a", pa, max_tokens=6)  # 1 block, grows at position 4
    b = await h.start("b", pb, max_tokens=8)  # 2 blocks: the pool is full
    assert h.pool.num_free == 0
    h.run()
    h.sched.admit(a)
    h.sched.admit(b)
    out_a, out_b = await asyncio.gather(h.collect(a), h.collect(b))
    await h.stop()
    assert (a.preemptions, b.preemptions, h.sched.preemptions) == (0, 1, 1)
    assert out_a == expected(pa, 6) and out_b == expected(pb, 8)
    # b was preempted before decoding position 6: its KV up to there is rebuilt from
    # its cached prompt block on, the tokens it had generated included, not the last
    assert h.model.prefills[-1] == ([14, 15], 4)
    assert [p for p, _ in positions_of(h.model, 15)] == list(range(5, 12))
    assert h.pool.num_used == 0


async def test_preempted_requests_resume_in_the_order_they_were_preempted():
    """Two preemptions, the youngest running request each time: c (growing at position
    4), then b (growing at 8, after the oldest took the last block). c resumes first, as
    soon as b's blocks are free; b only once the oldest has finished. Each is recomputed
    from the prompt and the tokens it had generated, and no output token changes."""
    h = Harness(num_blocks=8)
    held = Reservation("held", 0, h.pool.allocate(3))  # the rest: 2 + 2 + 1 reserved blocks
    pa, pb, pc = [0, 1, 2, 3], [20, 21, 22, 23], [40, 41]
    a = await h.start("a", pa, max_tokens=8)
    b = await h.start("b", pb, max_tokens=8)
    c = await h.start("c", pc, max_tokens=6)
    assert h.pool.num_free == 0
    h.run()
    for r in (a, b, c):
        h.sched.admit(r)
    outs = await asyncio.gather(h.collect(a), h.collect(b), h.collect(c))
    await h.stop()
    assert outs == [expected(pa, 8), expected(pb, 8), expected(pc, 6)]
    assert (a.preemptions, b.preemptions, c.preemptions) == (0, 1, 1)
    assert h.model.prefills[3:] == [  # after the three prompts: the recomputes, in order
        ([40, 41, 42, 43], 0),  # c, preempted at position 4
        ([20, 21, 22, 23, 24, 25, 26, 27], 0),  # b, preempted at position 8
    ]
    # every decode step of every request had exactly the blocks its position needs
    for first in (4, 24, 42):
        steps = positions_of(h.model, first)
        assert steps and all(n == p // BS + 1 for p, n in steps), (first, steps)
    h.sched.free(held)
    assert h.pool.num_used == 0 and h.pool.num_free == h.pool.num_blocks


async def test_a_victim_that_cannot_be_recomputed_fails_with_memory_error():
    """Without its prompt ids (a disaggregated request) the youngest cannot be rebuilt:
    it ends with MemoryError instead of waiting, and the older request still gets every
    token (it may itself wait until the failed request's blocks are released)."""
    h = Harness(num_blocks=3)
    pa, pb = [0, 1, 2], [10, 11, 12, 13, 14]
    a = await h.start("a", pa, max_tokens=6)
    b = await h.start("b", pb, max_tokens=8)
    b.res.prompt_ids = []
    h.run()
    h.sched.admit(a)
    h.sched.admit(b)
    out_a, out_b = await asyncio.gather(h.collect(a), h.collect(b))
    await h.stop()
    assert out_a == expected(pa, 6)
    assert isinstance(out_b, MemoryError) and "retry" in str(out_b)
    assert b.preemptions == 0 and not h.sched.waiting
    assert h.pool.num_used == 0


async def test_a_batch_larger_than_max_batch_shares_the_steps():
    h = Harness(num_blocks=8, max_batch=1)
    a = await h.start("a", [0, 1, 2], max_tokens=4)
    b = await h.start("b", [30, 31, 32], max_tokens=4)
    h.sched.admit(a)
    h.sched.admit(b)
    h.run()
    await asyncio.gather(h.collect(a), h.collect(b))
    await h.stop()
    firsts = [step[0][0] for step in h.model.decodes]
    assert [len(step) for step in h.model.decodes] == [1] * 6
    assert firsts == [3, 33, 4, 34, 5, 35]  # round robin, not one request to its end
    assert h.pool.num_used == 0


async def test_a_failed_victim_frees_its_blocks_before_anyone_else_is_preempted():
    """The youngest cannot be recomputed: it fails and its blocks go back to the pool
    at once, so the oldest's growth takes one of them and the middle request is not
    preempted too (its blocks held until the failed RPC ended, the next miss did)."""
    h = Harness(num_blocks=4)
    pa, pb, pc = [0, 1, 2], [20], [40]
    a = await h.start("a", pa, max_tokens=6)  # 1 block each; a grows at its 2nd step
    b = await h.start("b", pb, max_tokens=3)  # b and c never grow
    c = await h.start("c", pc, max_tokens=3)
    held = Reservation("held", 0, h.pool.allocate(1))
    c.res.prompt_ids = []  # cannot be rebuilt
    assert h.pool.num_free == 0
    h.run()
    for r in (a, b, c):
        h.sched.admit(r)
    # nobody releases c's blocks for it: its stream's end is read only after the others
    out_a, out_b = await asyncio.gather(h.collect(a), h.collect(b))
    out_c = await h.collect(c)
    await h.stop()
    assert isinstance(out_c, MemoryError)
    assert out_a == expected(pa, 6) and out_b == expected(pb, 3)
    assert (a.preemptions, b.preemptions, h.sched.preemptions) == (0, 0, 0)
    h.sched.free(held)
    assert h.pool.num_used == 0


def test_a_request_that_leaves_while_its_kv_is_recomputed_frees_after_and_stays_gone():
    """Preempted request b is being resumed (its prompt recomputed in a worker thread) when
    its client goes away: its blocks go back only after the compute that writes them, it
    is not re-added to the batch, and the request queued behind it (c) still decodes."""
    import threading

    gate, started = threading.Event(), threading.Event()

    class Blocking(FakeModel):
        def forward_prefill(self, token_ids, start_pos, pool, table, on_layer_done=None):
            started.set()
            gate.wait(10)
            return super().forward_prefill(token_ids, start_pos, pool, table)

    async def go():
        pool = KVPool(CFG, 32, BS)
        s = BatchScheduler(
            Blocking(),
            pool,
            BS,
            8,
            64,
            frozenset(),
            lambda *a: None,
            lambda *a: None,
            {"generated": 0},
        )

        def preempted(rid):
            res = Reservation(rid, 8, [])
            res.prompt_ids = list(range(8))
            res.hashes = prefix_hashes(b"x", res.prompt_ids, BS)
            res.generated = [9, 10]
            res.kv_ready.set()
            return Running(res, 10, 9, 3, 2, Sampling(ignore_eos=True), frozenset())

        b, c = preempted("b"), preempted("c")
        s.waiting.extend([b, c])
        task = asyncio.create_task(s.run())
        try:
            while not started.is_set():
                await asyncio.sleep(0.01)
            table = list(b.res.blocks)
            s.leave(b)
            s.free(b.res)  # what retire does
            assert [pool.refcount(x) for x in table] == [1] * len(table)  # still written
            gate.set()
            for _ in range(200):
                if len(c.res.generated) > 2 + 2:
                    break
                await asyncio.sleep(0.01)
            assert b not in s.running and b not in s.waiting and b.res.blocks == []
            assert len(c.res.generated) > 4  # c was resumed and decoded, not dropped
        finally:
            gate.set()
            task.cancel()

    asyncio.run(go())
