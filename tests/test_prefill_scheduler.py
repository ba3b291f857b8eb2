"""The prefill node's scheduling and block accounting, with fakes (no processes, no
model, no transfer engine): requests take the compute slot one at a time in arrival
order, the queue depth counts exactly the waiters, and every KV block a request takes
(its cached prefix, the blocks fetched from the store, the new ones) is given back when
it finishes, fails, runs out of room or is cancelled; the new full blocks stay in the
prefix cache and are held only until the background store put ends."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.rdma import TransferError
from kvmesh.services.common.hashing import prefix_hashes
from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.config import ModelConfig
from kvmesh.services.engine.kv_pool import KVPool, OutOfBlocks
from kvmesh.services.engine.model import PrefillStopped
from kvmesh.services.model_node import drop_payload
from kvmesh.services.node_config import NodeConfig
from kvmesh.services.prefill.deadline import Slowdown, TooLate
from kvmesh.services.prefill.queue import ComputeQueue
from kvmesh.services.prefill.server import PrefillNode, PrefillServicer

BS = 4
VOCAB = 16
LAYERS = 2
CFG = ModelConfig(
    vocab_size=VOCAB,
    hidden_size=4,
    num_layers=LAYERS,
    num_heads=1,
    num_kv_heads=1,
    head_dim=2,
    intermediate_size=4,
    max_position_embeddings=256,
)
SEED = b"prefill-test"


# ------------------------------------------------------------------ the compute queue


async def test_queue_serves_in_arrival_order_and_counts_only_waiters():
    q = ComputeQueue()
    order: list[int] = []
    release = asyncio.Event()

    async def request(i: int) -> None:
        async with q.turn():
            order.append(i)
            if i == 0:
                await release.wait()

    tasks = [asyncio.create_task(request(i)) for i in range(5)]
    await asyncio.sleep(0.01)
    assert order == [0] and q.busy
    assert q.depth == 4  # the running one is not queued
    release.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert q.depth == 0 and not q.busy


async def test_a_cancelled_waiter_leaves_the_queue_and_blocks_nobody():
    q = ComputeQueue()
    release = asyncio.Event()
    served: list[str] = []

    async def request(name: str, hold: bool = False) -> None:
        async with q.turn():
            served.append(name)
            if hold:
                await release.wait()

    first = asyncio.create_task(request("first", hold=True))
    await asyncio.sleep(0)
    gone = asyncio.create_task(request("gone"))
    last = asyncio.create_task(request("last"))
    await asyncio.sleep(0.01)
    assert q.depth == 2
    gone.cancel()
    await asyncio.sleep(0.01)
    assert q.depth == 1
    release.set()
    await asyncio.gather(first, last)
    assert gone.cancelled() and served == ["first", "last"]
    assert q.depth == 0 and not q.busy


async def test_a_failing_request_frees_the_slot_and_the_wait_is_measured():
    q = ComputeQueue()

    async def failing() -> None:
        async with q.turn():
            await asyncio.sleep(0.05)
            raise RuntimeError("boom")

    t = asyncio.create_task(failing())
    await asyncio.sleep(0)
    async with q.turn() as waited:
        assert waited >= 0.04  # queued behind the failing request
        assert q.busy
    with pytest.raises(RuntimeError):
        await t
    async with q.turn() as waited:
        assert waited < 0.04  # nobody ahead


async def test_idle_waits_for_the_queue_without_joining_it():
    q = ComputeQueue()
    release = asyncio.Event()
    done: list[str] = []

    async def request() -> None:
        async with q.turn():
            await release.wait()
            done.append("request")

    t = asyncio.create_task(request())
    await asyncio.sleep(0)
    idle = asyncio.create_task(q.idle())
    await asyncio.sleep(0.01)
    assert q.depth == 0 and not idle.done()  # draining is not a queued request
    release.set()
    await idle
    assert done == ["request"]
    await t


# ------------------------------------------------------------------ fakes for the node


class FakeModel:
    """Records each prefill; calls the layer callback once per layer."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.calls: list[tuple[list[int], int, list[int]]] = []
        self.fail = fail

    def forward_prefill(self, token_ids, start_pos, pool, table, on_layer_done=None):
        self.calls.append((token_ids.tolist(), start_pos, list(table)))
        for layer in range(LAYERS):
            if on_layer_done is not None:
                on_layer_done(layer)
        if self.fail is not None:
            raise self.fail
        logits = torch.zeros(VOCAB)
        logits[(token_ids[-1].item() + 1) % VOCAB] = 1.0
        return logits

    def forward_prefill_chunked(
        self,
        token_ids,
        start_pos,
        pool,
        table,
        chunk_tokens,
        on_layer_done=None,
        should_stop=None,
    ):
        """What the node calls: ``forward_prefill`` chunk by chunk, as the real model."""
        n, logits = len(token_ids), None
        for lo in range(0, n, chunk_tokens):
            if lo and should_stop is not None and should_stop():
                raise PrefillStopped(f"prefill stopped after {lo} of {n} new tokens")
            a, b = start_pos + lo, start_pos + min(n, lo + chunk_tokens)
            cb = None if on_layer_done is None else (lambda l, a=a, b=b: on_layer_done(l, a, b))
            logits = self.forward_prefill(token_ids[lo : b - start_pos], a, pool, table, cb)
        return logits


class FakeTE:
    """Writes complete on the next loop turn (or fail); notify records its order."""

    def __init__(self, fail_writes: bool = False) -> None:
        self.writes: list[list] = []
        self.log: list[str] = []
        self.fail_writes = fail_writes

    def write(self, peer, slices):
        self.writes.append(list(slices))
        fut = asyncio.get_running_loop().create_future()
        i = len(self.writes) - 1

        def land() -> None:
            self.log.append(f"write {i}")
            if self.fail_writes:
                fut.set_exception(TransferError("link down"))
            else:
                fut.set_result(None)

        asyncio.get_running_loop().call_soon(land)
        return fut

    async def notify(self, peer, payload):
        self.log.append(f"notify {payload.decode()}")


class FakeStore:
    """A store holding ``have`` (hash -> bytes) blocks; ``gate`` holds puts or gets."""

    def __init__(self, have: dict[bytes, bytes] | None = None) -> None:
        self.have = have or {}
        self.gets: list[list[bytes]] = []
        self.puts: list[list[bytes]] = []
        self.get_gate: asyncio.Event | None = None
        self.put_gate: asyncio.Event | None = None

    def master_address(self):
        return "master:1"

    async def prefix_len(self, hashes):
        n = 0
        while n < len(hashes) and hashes[n] in self.have:
            n += 1
        return n

    async def get_into(self, hashes, region, offsets, capacities, prefix):
        self.gets.append(list(hashes))
        if self.get_gate is not None:
            await self.get_gate.wait()
        return [len(self.have[h]) for h in hashes]

    async def put_from(self, hashes, region, offsets, sizes):
        self.puts.append(list(hashes))
        if self.put_gate is not None:
            await self.put_gate.wait()
        return [True] * len(hashes)


class FakeEvents:
    def __init__(self) -> None:
        self.prefills: list[tuple[int, int]] = []
        self.fetches: list[tuple[int, float]] = []

    def record_prefill(self, new, cached, ms):
        self.prefills.append((new, cached))

    def record_store_fetch(self, nbytes, ms):
        self.fetches.append((nbytes, ms))


class FakeContext:
    async def abort(self, code, details):
        raise grpc.RpcError(code, details)


async def started(cond, task: asyncio.Task, timeout_s: float = 10.0) -> None:
    """Waits (bounded) until ``cond()``; a task that ended first fails the test at once
    with its own error (an AttributeError from a stale fake, say), not a timeout."""
    async with asyncio.timeout(timeout_s):
        while not cond():
            if task.done():
                await task  # raises what ended it
                pytest.fail("the request ended before the condition held")
            await asyncio.sleep(0.001)


def make_node(num_blocks=16, model=None, te=None, store=None) -> PrefillNode:
    """A PrefillNode without a server: only what a Prefill call touches is set."""
    node = PrefillNode.__new__(PrefillNode)
    node.node_id = "prefill-0"
    node.cfg = NodeConfig(block_size=BS)  # the real config: no stale stand-in
    node.pool = KVPool(CFG, num_blocks, BS)
    node.model = model or FakeModel()
    node.te = te or FakeTE()
    node.store = store
    node.pool_region = 0
    node.model_config = CFG
    node.counters = {"computed": 0, "cached": 0, "fetched": 0, "generated": 0, "warmed": 0}
    node.tokenizer = ByteTokenizer()  # (its eos ids: the first token's penalties' history)
    node.events = FakeEvents()
    node.compute = ComputeQueue()
    node.slowdown = Slowdown()
    node.background = set()
    return node


def request(rid: str, tokens: list[int], first_target_block: int = 100) -> pb.PrefillRequest:
    nblocks = -(-len(tokens) // BS)
    return pb.PrefillRequest(
        request_id=rid,
        token_ids=tokens,
        block_hashes=prefix_hashes(SEED, tokens, BS),
        target=pb.KVTarget(
            node_id="decode-0",
            data_address="decode:1",
            region_id=7,
            block_ids=list(range(first_target_block, first_target_block + nblocks)),
            block_nbytes=KVPool.block_bytes(CFG, BS, torch.float32),
        ),
    )


PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 2 full blocks + 2 tokens


# ------------------------------------------------------------------ block accounting


async def test_a_prefill_gives_back_every_block_and_caches_its_full_ones():
    node = make_node()
    resp = await node.prefill(request("a", PROMPT))
    assert (resp.first_token, resp.computed_tokens, resp.cached_tokens) == (11, 10, 0)
    pool = node.pool
    assert pool.num_used == 0  # nothing held after the request
    assert pool.num_cached == 2 and pool.num_free == pool.num_blocks  # cached, evictable
    assert node.model.calls[0][:2] == (PROMPT, 0)
    # one write per layer, each of every new block, then the ordered notify
    assert len(node.te.writes) == LAYERS
    assert all(len(w) == 3 for w in node.te.writes)
    assert [s.remote_offset // pool.block_nbytes for s in node.te.writes[1]] == [100, 101, 102]
    assert node.te.log[-1] == "notify kv:a" and len(node.te.log) == LAYERS + 1
    assert node.counters["computed"] == 10


async def test_a_repeated_prefix_is_reused_and_written_whole():
    node = make_node()
    await node.prefill(request("a", PROMPT))
    node.te.writes.clear()
    resp = await node.prefill(request("b", PROMPT[:8] + [11, 12, 13], first_target_block=200))
    assert (resp.computed_tokens, resp.cached_tokens) == (3, 8)
    assert node.model.calls[1][:2] == ([11, 12, 13], 8)  # only the new tokens computed
    prefix_write = node.te.writes[0]  # the 2 cached blocks, whole, into the target's first two
    assert [s.remote_offset // node.pool.block_nbytes for s in prefix_write] == [200, 201]
    assert all(s.length == node.pool.block_nbytes for s in prefix_write)
    assert node.pool.num_used == 0


async def test_the_last_token_is_always_computed_even_when_every_block_is_cached():
    node = make_node()
    tokens = PROMPT[:8]  # exactly 2 full blocks
    await node.prefill(request("a", tokens))
    resp = await node.prefill(request("b", tokens))
    assert (resp.computed_tokens, resp.cached_tokens) == (4, 4)  # the logits need >= 1 token
    assert node.pool.num_used == 0


async def test_a_failed_computation_gives_back_the_prefix_and_the_new_blocks():
    node = make_node()
    await node.prefill(request("a", PROMPT))
    node.model.fail = RuntimeError("kernel failed")
    with pytest.raises(RuntimeError, match="kernel failed"):
        await node.prefill(request("b", PROMPT[:8] + [11, 12, 13]))
    assert node.pool.num_used == 0
    assert node.pool.num_cached == 2  # the cached prefix is still there, evictable
    assert not node.compute.busy


async def test_a_failed_handoff_gives_back_every_block_and_sends_no_notify():
    node = make_node(te=FakeTE(fail_writes=True))
    with pytest.raises(TransferError):
        await node.prefill(request("a", PROMPT))
    assert node.pool.num_used == 0
    assert not any(e.startswith("notify") for e in node.te.log)


async def test_no_room_raises_out_of_blocks_and_releases_the_prefix():
    node = make_node(num_blocks=4)
    await node.prefill(request("a", PROMPT))  # 3 blocks, 2 of them cached afterwards
    held = node.pool.allocate(2)  # only the 2 cached (evictable) blocks stay available
    long = PROMPT[:8] + list(range(20))  # 2 cached blocks + 5 new ones: no room
    with pytest.raises(OutOfBlocks):
        await node.prefill(request("b", long))
    node.pool.free(held)
    assert node.pool.num_used == 0 and node.pool.num_free == 4


async def test_the_servicer_answers_no_room_with_resource_exhausted():
    node = make_node(num_blocks=2)
    with pytest.raises(grpc.RpcError) as e:
        await PrefillServicer(node).Prefill(request("a", PROMPT), FakeContext())
    assert e.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no room" in e.value.args[1]
    assert node.pool.num_used == 0


async def test_blocks_fetched_from_the_store_are_counted_and_given_back():
    hashes = prefix_hashes(SEED, PROMPT, BS)
    block = b"x" * KVPool.block_bytes(CFG, BS, torch.float32)
    store = FakeStore({hashes[0]: block, hashes[1]: block})
    node = make_node(store=store)
    resp = await node.prefill(request("a", PROMPT))
    assert (resp.fetched_tokens, resp.computed_tokens) == (8, 2)
    assert store.gets == [hashes]
    # the fetch is reported for the conductor's fetch-vs-recompute pricing: both blocks
    assert [n for n, _ in node.events.fetches] == [2 * len(block)]
    assert node.pool.num_used == 0 and node.pool.num_cached == 2
    assert store.puts == []  # nothing new to put: both full blocks came from the store


async def test_no_room_to_fetch_means_recompute_not_an_error():
    hashes = prefix_hashes(SEED, PROMPT, BS)
    block = b"x" * KVPool.block_bytes(CFG, BS, torch.float32)
    store = FakeStore({hashes[0]: block, hashes[1]: block})
    node = make_node(num_blocks=3, store=store)
    held = node.pool.allocate(2)
    assert await node._fetch(hashes, [tuple(PROMPT[:4]), tuple(PROMPT[4:8])], 0) == []
    assert store.gets == []  # nothing read into blocks it does not have
    node.pool.free(held)
    assert node.pool.num_used == 0


async def test_a_request_cancelled_during_the_store_fetch_frees_its_blocks_once_the_read_ends():
    """Cancelling the wait does not stop a read landing in pool blocks: they are given back
    (and the compute slot passed on) only when the read has ended, never while it writes."""
    base = PROMPT[:4]
    tokens = base + [5, 6, 7, 8, 9, 10]
    hashes = prefix_hashes(SEED, tokens, BS)
    block = b"x" * KVPool.block_bytes(CFG, BS, torch.float32)
    store = FakeStore()
    node = make_node(store=store)
    await node.prefill(request("a", base + [0, 0]))  # block 0 now cached locally
    store.have = {hashes[1]: block}
    store.get_gate = asyncio.Event()
    t = asyncio.create_task(node.prefill(request("b", tokens)))
    await started(lambda: bool(store.gets), t)
    assert node.pool.num_used == 2  # the local prefix block and the one being fetched
    t.cancel()
    await asyncio.sleep(0.02)
    assert not t.done()  # the read is still landing in its block
    assert node.pool.num_used == 2 and node.compute.busy
    store.get_gate.set()  # the read ends
    with pytest.raises(asyncio.CancelledError):
        await t
    assert node.pool.num_used == 0
    assert not node.compute.busy and node.compute.depth == 0
    assert not node.model.calls[1:]  # nothing computed for the cancelled request


class BlockingModel(FakeModel):
    """A forward that runs until ``release`` is set, on its worker thread, recording how
    many forwards ever ran at once."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.running = 0
        self.started = 0
        self.most = 0
        self.lock = threading.Lock()

    def forward_prefill(self, token_ids, start_pos, pool, table, on_layer_done=None):
        with self.lock:
            self.running += 1
            self.started += 1
            self.most = max(self.most, self.running)
        try:
            assert self.release.wait(10)
            return super().forward_prefill(token_ids, start_pos, pool, table, on_layer_done)
        finally:
            with self.lock:
                self.running -= 1


async def test_a_request_cancelled_while_computing_holds_its_blocks_and_the_slot_until_the_forward_ends():
    """The forward runs on a worker thread that a cancellation cannot stop: its table must
    not be freed, nor a second forward start, until it returns."""
    model = BlockingModel()
    node = make_node(model=model)
    t = asyncio.create_task(node.prefill(request("a", PROMPT)))
    await started(lambda: model.started > 0, t)
    used = node.pool.num_used
    assert used == 3
    t.cancel()
    other = asyncio.create_task(node.prefill(request("b", [9, 9, 9], first_target_block=200)))
    await asyncio.sleep(0.05)
    assert not t.done() and node.pool.num_used == used  # still written by the forward
    assert model.started == 1  # the next request waits for the slot
    model.release.set()
    with pytest.raises(asyncio.CancelledError):
        await t
    resp = await other
    assert resp.computed_tokens == 3
    assert model.most == 1  # never two forwards at once
    assert node.pool.num_used == 0 and not node.compute.busy


async def test_the_store_put_holds_the_new_blocks_until_it_ends():
    store = FakeStore()
    store.put_gate = asyncio.Event()
    node = make_node(store=store)
    await node.prefill(request("a", PROMPT))
    await asyncio.sleep(0)  # the put task starts, then waits on the gate
    assert store.puts == [prefix_hashes(SEED, PROMPT, BS)]
    assert node.pool.num_used == 2  # the 2 full blocks, until the put has read them
    store.put_gate.set()
    await asyncio.wait(node.background)
    assert node.pool.num_used == 0 and node.pool.num_cached == 2


class HeldTE(FakeTE):
    """The first write fails at once; the others stay in flight until ``land_all``."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[asyncio.Future] = []

    def write(self, peer, slices):
        self.writes.append(list(slices))
        fut = asyncio.get_running_loop().create_future()
        if len(self.writes) == 1:
            fut.set_exception(TransferError("link down"))
        else:
            self.held.append(fut)
        return fut

    def land_all(self) -> None:
        for f in self.held:
            if not f.done():
                f.set_result(None)


async def test_a_request_cancelled_while_its_failed_handoff_settles_frees_its_blocks():
    """The failure waits for the writes still in flight (they read the pool blocks); a
    cancellation landing during that wait still frees the blocks once they end, and
    sends no ``drop``: a failed write means the decode node must keep its fence."""
    te = HeldTE()
    node = make_node(te=te)
    task = asyncio.create_task(node.prefill(request("a", PROMPT)))
    await started(lambda: len(te.held) >= 1 and node.pool.num_used > 0, task)
    for _ in range(20):  # let the failure reach settle()
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.01)
    assert node.pool.num_used > 0  # not before the writes reading them have ended
    te.land_all()
    with pytest.raises((asyncio.CancelledError, TransferError)):
        await task
    assert node.pool.num_used == 0
    await asyncio.sleep(0.01)
    assert not any(e.startswith("notify") for e in te.log), te.log


async def test_a_queued_request_past_its_deadline_is_refused_without_work_and_dropped():
    """Behind a slot held longer than its deadline allows, a request leaves the queue with
    TooLate (counted), computes nothing, takes no block, and tells the decode node it will
    never write its reservation (drop); the servicer answers RESOURCE_EXHAUSTED, reason
    deadline. A request with no deadline behind the same slot waits and is served."""
    node = make_node()
    late = request("late", PROMPT)
    late.deadline_ms, late.expected_ms = 80.0, 20.0
    patient = request("patient", PROMPT, first_target_block=200)
    held = asyncio.Event()
    release = asyncio.Event()

    async def hold():
        async with node.compute.turn():
            held.set()
            await release.wait()

    h = asyncio.create_task(hold())
    await held.wait()
    t_late = asyncio.create_task(node.prefill(late))
    t_patient = asyncio.create_task(node.prefill(patient))
    with pytest.raises(TooLate, match="past its TTFT deadline"):
        await t_late
    assert not t_patient.done() and node.compute.depth == 1
    assert node.model.calls == [] and node.pool.num_used == 0
    await asyncio.sleep(0)  # the drop notify runs in the background
    assert node.te.log == ["notify " + drop_payload("prefill-0", "late").decode()]
    release.set()
    await h
    await t_patient
    assert node.counters["computed"] == len(PROMPT)

    calls: list = []

    class Ctx:  # a servicer context: abort records the status, raises as grpc.aio does
        async def abort(self, code, details, trailing_metadata=()):
            calls.append((code, details, dict(trailing_metadata)))
            raise grpc.aio.AbortError()

    ctx = Ctx()
    release2 = asyncio.Event()

    async def hold2():
        async with node.compute.turn():
            await release2.wait()

    h2 = asyncio.create_task(hold2())
    await asyncio.sleep(0)
    again = request("late2", PROMPT)
    again.deadline_ms, again.expected_ms = 50.0, 20.0
    with pytest.raises(grpc.aio.AbortError):
        await PrefillServicer(node).Prefill(again, ctx)
    release2.set()
    await h2
    ((code, details, md),) = calls
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and md["kvmesh-reject-reason"] == "deadline"
    assert "late2" in details and "before any work" in details
