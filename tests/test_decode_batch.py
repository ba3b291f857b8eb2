"""The decode node's continuous batching in a real cluster: prompts computed on the node
in chunks (a small step token budget), blocks added as requests grow, and preemption of
the youngest request when the pool runs out, with recompute later: every output stays
exactly the single-process reference."""

from __future__ import annotations

import threading

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common.hashing import prefix_hashes
from kvmesh.services.common.ownership import WRITERS_MD
from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import status

BS = 16
TOK = ByteTokenizer()
# 16 KiB per block for the tiny model at block size 16: 40 blocks in the decode pool
DECODE_ARGS = ["--kv-memory", "640KiB", "--step-token-budget", "40", "--fence-s", "1.5"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("batch")),
        node_args=["--block-size", str(BS), "--segment-memory", "0"],
        decode_args=DECODE_ARGS,
    )
    c.start()
    yield c
    c.stop()


def _pool_idle(addr: str, timeout: float = 15.0) -> None:
    """Waits until every block of the decode node's pool is back (an earlier test's
    released reservation may be fenced for a while: ``--fence-s``)."""
    import time

    with grpc.insecure_channel(addr) as ch:
        stub = pbg.DecodeNodeStub(ch)
        deadline = time.monotonic() + timeout
        while True:
            st = stub.Status(pb.NodeStatusRequest(), timeout=5)
            if st.kv_blocks_free == st.kv_blocks_total or time.monotonic() > deadline:
                assert st.kv_blocks_free == st.kv_blocks_total, "the pool never came back"
                return
            time.sleep(0.1)


def decode_here(
    addr: str, fingerprint: str, rid: str, ids: list[int], max_tokens: int
) -> list[int]:
    """Reserve + Decode(prefill_here) straight on the decode node."""
    with grpc.insecure_channel(addr) as ch:
        stub = pbg.DecodeNodeStub(ch)
        stub.Reserve(
            pb.ReserveRequest(request_id=rid, prompt_tokens=len(ids), max_tokens=max_tokens),
            timeout=10,
        )
        out = []
        for m in stub.Decode(
            pb.DecodeRequest(
                request_id=rid,
                max_tokens=max_tokens,
                prefill_here=True,
                prompt_token_ids=ids,
                block_hashes=prefix_hashes(bytes.fromhex(fingerprint), ids, BS),
                sampling=pb.SamplingParams(ignore_eos=True),
            ),
            timeout=120,
        ):
            out.extend(m.token_ids)
        return out


def test_chunked_prompts_and_preemption_keep_every_token(cluster):
    model = LlamaModel.from_preset("tiny", seed=0)
    d = next(n for n in status(cluster.conductor).nodes if n.role == "decode")
    prompts = [TOK.encode(f"request {i}: " + "lorem ipsum dolor sit amet " * 3) for i in range(4)]
    max_tokens = 130  # 4 x (6 prompt + 9 generated blocks) = 60 blocks > 40 in the pool
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = decode_here(d.grpc_address, d.fingerprint, f"b{i}", prompts[i], max_tokens)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    for i, ids in enumerate(prompts):
        assert results[i] == model.reference_generate(ids, max_tokens), i
    log = open(f"{cluster.workdir}/decode-0.log").read()
    assert "preempted" in log  # the pool really ran out and requests were recomputed
    after = next(n for n in status(cluster.conductor).nodes if n.role == "decode")
    assert after.kv_blocks_free == after.kv_blocks_total  # nothing leaked


def test_blocks_of_an_abandoned_prefill_are_fenced_before_reuse(cluster):
    """A reservation released before its KV arrived keeps its blocks out of the pool for
    fence_s: a cut-off prefill node's late writes must not land in another request."""
    import time

    d = next(n for n in status(cluster.conductor).nodes if n.role == "decode")
    total = d.kv_blocks_total
    with grpc.insecure_channel(d.grpc_address) as ch:
        stub = pbg.DecodeNodeStub(ch)
        target = stub.Reserve(
            pb.ReserveRequest(request_id="abandoned", prompt_tokens=64, max_tokens=8), timeout=10
        ).target
        assert stub.Release(pb.ReleaseRequest(request_id="abandoned"), timeout=10).released
        fenced = stub.Status(pb.NodeStatusRequest(), timeout=5).kv_blocks_free
        assert fenced == total - len(target.block_ids)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if stub.Status(pb.NodeStatusRequest(), timeout=5).kv_blocks_free == total:
                break
            time.sleep(0.2)
        assert stub.Status(pb.NodeStatusRequest(), timeout=5).kv_blocks_free == total


def _run_here(stub, fingerprint: str, rid: str, ids: list[int], pin: bool):
    """Reserve (pinning the cached prefix when ``pin``) + Decode(prefill_here), one token:
    the Reserve answer and the prefill's report."""
    hashes = prefix_hashes(bytes.fromhex(fingerprint), ids, BS)
    reserved = stub.Reserve(
        pb.ReserveRequest(
            request_id=rid,
            prompt_tokens=len(ids),
            max_tokens=1,
            prefill_here=pin,
            block_hashes=hashes if pin else [],
        ),
        timeout=10,
    )
    msgs = list(
        stub.Decode(
            pb.DecodeRequest(
                request_id=rid,
                max_tokens=1,
                prefill_here=True,
                prompt_token_ids=ids,
                block_hashes=hashes,
                sampling=pb.SamplingParams(ignore_eos=True),
            ),
            timeout=120,
        )
    )
    return reserved, msgs[0]


def test_a_prefill_here_reserve_cannot_evict_the_prefix_it_computes_from(cluster):
    """A colocated / decode-direct request's Reserve takes blocks for its whole prompt. When
    the pool is full of cached blocks and its own prefix is the least recently used, a
    plain Reserve evicts that prefix and the node recomputes it (the conductor's estimate
    counted it cached); with prefill_here the node pins the prefix first."""
    model = LlamaModel.from_preset("tiny", seed=0)
    d = next(n for n in status(cluster.conductor).nodes if n.role == "decode")

    def ids(tag: str, n: int) -> list[int]:
        return list(TOK.encode((tag + " lorem ipsum dolor sit amet ") * 40))[:n]

    with grpc.insecure_channel(d.grpc_address) as ch:
        stub = pbg.DecodeNodeStub(ch)
        for pin in (False, True):
            tag = f"pin={pin}"
            # 38 cached blocks push out whatever was there; then the prefix (10 blocks),
            # then 25 blocks of another prompt: the prefix is now the oldest but for a
            # few blocks, and its next turn needs 12 blocks, more than those few
            _run_here(stub, d.fingerprint, f"flush-{tag}", ids("flush" + tag, 38 * BS), False)
            prefix = ids("prefix" + tag, 10 * BS)
            _run_here(stub, d.fingerprint, f"first-{tag}", prefix, False)
            _run_here(stub, d.fingerprint, f"other-{tag}", ids("other" + tag, 25 * BS), False)
            turn = prefix + ids("turn" + tag, BS)
            reserved, first = _run_here(stub, d.fingerprint, f"turn-{tag}", turn, pin)
            assert first.token_ids == model.reference_generate(turn, 1)
            if not pin:  # the scenario squeezes: a plain Reserve evicted the prefix
                assert first.prefill.cached_tokens < 10 * BS
                assert reserved.cached_tokens == 0 and reserved.target.block_ids
            else:
                assert reserved.cached_tokens == 10 * BS
                assert first.prefill.cached_tokens == 10 * BS
                assert first.prefill.computed_tokens == BS
                assert not reserved.target.block_ids  # no other node may write them
        after = stub.Status(pb.NodeStatusRequest(), timeout=5)
        assert after.kv_blocks_free == after.kv_blocks_total  # pins and blocks all back


def test_reserve_refuses_hashes_it_cannot_use(cluster):
    d = next(n for n in status(cluster.conductor).nodes if n.role == "decode")
    with grpc.insecure_channel(d.grpc_address) as ch:
        stub = pbg.DecodeNodeStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Reserve(
                pb.ReserveRequest(
                    request_id="x2", prompt_tokens=BS, max_tokens=1, block_hashes=[b"a", b"b"]
                ),
                timeout=10,
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most one per full block" in e.value.details()
        # a prefill_here reservation is computed here: a Decode waiting for KV is refused
        stub.Reserve(
            pb.ReserveRequest(request_id="x3", prompt_tokens=BS, max_tokens=2, prefill_here=True),
            timeout=10,
        )
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Decode(pb.DecodeRequest(request_id="x3", max_tokens=2), timeout=10))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "must set prefill_here" in e.value.details()
        after = stub.Status(pb.NodeStatusRequest(), timeout=5)
        assert after.kv_blocks_free == after.kv_blocks_total  # nothing held


def test_a_disaggregated_reserve_shares_the_prefix_the_decode_node_holds(cluster):
    """Disaggregated, a Reserve that names the prompt's block hashes pins the cached prefix
    the decode node holds: two requests sharing it hold one copy, the prefill node writes
    only the blocks after it, and the output is the single-process reference's."""
    model = LlamaModel.from_preset("tiny", seed=0)
    nodes = {n.role: n for n in status(cluster.conductor).nodes}
    d, p = nodes["decode"], nodes["prefill"]
    text = (" the shared system prompt of many users" * 10).encode()
    prefix = list(TOK.encode(text.decode()))[: 10 * BS]
    turns = [
        prefix + list(TOK.encode(f" and question {i} of mine" * 3))[: 2 * BS + 5] for i in (1, 2)
    ]
    assert all(len(ids) == 12 * BS + 5 for ids in turns)
    with grpc.insecure_channel(d.grpc_address) as dch, grpc.insecure_channel(p.grpc_address) as pch:
        dstub, pstub = pbg.DecodeNodeStub(dch), pbg.PrefillNodeStub(pch)
        _run_here(dstub, d.fingerprint, "shared-first", prefix, False)  # now cached there
        free0 = dstub.Status(pb.NodeStatusRequest(), timeout=5).kv_blocks_free
        targets, frees = [], []
        for i, ids in enumerate(turns):
            reserved = dstub.Reserve(
                pb.ReserveRequest(
                    request_id=f"shared-{i}",
                    prompt_tokens=len(ids),
                    max_tokens=4,
                    block_hashes=prefix_hashes(bytes.fromhex(d.fingerprint), ids, BS),
                ),
                timeout=10,
            )
            assert reserved.prefix_pinned and reserved.cached_tokens == 10 * BS
            assert reserved.target.held_blocks == 10
            assert len(reserved.target.block_ids) == len(ids) // BS + 1 - 10
            targets.append(reserved.target)
            frees.append(dstub.Status(pb.NodeStatusRequest(), timeout=5).kv_blocks_free)
        # the first pinned the cached prefix (10 blocks no longer evictable) and took 3;
        # the second shares those 10 and takes only its own 3
        assert free0 - frees[0] == 13 and frees[0] - frees[1] == 3
        # a third, the first's prompt again, reserved now: the decode node holds the
        # prefix only, the prefill node will hold the first's question blocks too, and
        # sends those two from its cache (prompt blocks 10 and 11 to the target's 0, 1)
        reserved = dstub.Reserve(
            pb.ReserveRequest(
                request_id="shared-2",
                prompt_tokens=len(turns[0]),
                max_tokens=4,
                block_hashes=prefix_hashes(bytes.fromhex(d.fingerprint), turns[0], BS),
            ),
            timeout=10,
        )
        assert reserved.target.held_blocks == 10
        targets.append(reserved.target)
        turns.append(turns[0])
        for i, ids in enumerate(turns):
            hashes = prefix_hashes(bytes.fromhex(d.fingerprint), ids, BS)
            presp = pstub.Prefill(
                pb.PrefillRequest(
                    request_id=f"shared-{i}",
                    token_ids=ids,
                    block_hashes=hashes,
                    target=targets[i],
                    sampling=pb.SamplingParams(ignore_eos=True),
                ),
                timeout=60,
            )
            out = [presp.first_token]
            for m in dstub.Decode(
                pb.DecodeRequest(
                    request_id=f"shared-{i}",
                    first_token=presp.first_token,
                    max_tokens=4,
                    prompt_token_ids=ids,
                    block_hashes=hashes,
                    sampling=pb.SamplingParams(ignore_eos=True),
                ),
                timeout=60,
            ):
                out.extend(m.token_ids)
            assert out == model.reference_generate(ids, 4), i
            if i == 2:
                assert presp.cached_tokens == 12 * BS  # (it did send from its cache)
        after = dstub.Status(pb.NodeStatusRequest(), timeout=5)
        assert after.kv_blocks_free == after.kv_blocks_total  # pins and blocks all back


def test_pinned_blocks_that_are_not_the_prompts_are_never_used_or_leaked(cluster):
    """Blocks pinned by the Reserve's hashes that the Decode's prompt does not bear out:
    computed here, they are replaced by fresh ones (the output is the prompt's own);
    written by a prefill node, the Decode is refused and every block comes back."""
    model = LlamaModel.from_preset("tiny", seed=0)
    nodes = {n.role: n for n in status(cluster.conductor).nodes}
    d, p = nodes["decode"], nodes["prefill"]
    fp = bytes.fromhex(d.fingerprint)
    cached = list(TOK.encode(" a prompt this node holds" * 20))[: 6 * BS]
    other = list(TOK.encode(" another prompt it does not" * 20))[: 6 * BS + 3]
    with grpc.insecure_channel(d.grpc_address) as dch, grpc.insecure_channel(p.grpc_address) as pch:
        dstub, pstub = pbg.DecodeNodeStub(dch), pbg.PrefillNodeStub(pch)
        _run_here(dstub, d.fingerprint, "held", cached, False)
        wrong = prefix_hashes(fp, cached + [1] * 3, BS)  # names the cached blocks
        reserved = dstub.Reserve(
            pb.ReserveRequest(
                request_id="mixed-here",
                prompt_tokens=len(other),
                max_tokens=3,
                block_hashes=wrong,
                prefill_here=True,
            ),
            timeout=10,
        )
        assert reserved.cached_tokens == 6 * BS
        msgs = list(
            dstub.Decode(
                pb.DecodeRequest(
                    request_id="mixed-here",
                    max_tokens=3,
                    prefill_here=True,
                    prompt_token_ids=other,
                    block_hashes=prefix_hashes(fp, other, BS),
                    sampling=pb.SamplingParams(ignore_eos=True),
                ),
                timeout=60,
            )
        )
        assert msgs[0].prefill.cached_tokens == 0  # none of the pinned blocks was used
        assert [t for m in msgs for t in m.token_ids] == model.reference_generate(other, 3)
        # disaggregated: the prefill node writes the blocks after the pinned ones, and
        # the Decode names the prompt's own hashes: refused, nothing kept or cached
        reserved = dstub.Reserve(
            pb.ReserveRequest(
                request_id="mixed-disagg",
                prompt_tokens=len(other),
                max_tokens=3,
                block_hashes=wrong,
            ),
            timeout=10,
        )
        assert reserved.target.held_blocks == 6
        pstub.Prefill(
            pb.PrefillRequest(
                request_id="mixed-disagg",
                token_ids=other,
                block_hashes=prefix_hashes(fp, other, BS),
                target=reserved.target,
            ),
            timeout=60,
        )
        with pytest.raises(grpc.RpcError) as e:
            list(
                dstub.Decode(
                    pb.DecodeRequest(
                        request_id="mixed-disagg",
                        max_tokens=3,
                        prompt_token_ids=other,
                        block_hashes=prefix_hashes(fp, other, BS),
                    ),
                    timeout=60,
                )
            )
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "holds other tokens than the prompt's" in e.value.details()
        after = dstub.Status(pb.NodeStatusRequest(), timeout=5)
        assert after.kv_blocks_free == after.kv_blocks_total  # every block came back
        # and the prefix it holds is still the right one
        _, first = _run_here(dstub, d.fingerprint, "held-again", cached + [7] * 3, True)
        assert first.prefill.cached_tokens == 6 * BS
        assert list(first.token_ids) == model.reference_generate(cached + [7] * 3, 1)


def test_a_prefill_node_refuses_a_target_holding_more_than_the_cached_prefix(cluster):
    p = next(n for n in status(cluster.conductor).nodes if n.role == "prefill")
    with grpc.insecure_channel(p.grpc_address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pbg.PrefillNodeStub(ch).Prefill(
                pb.PrefillRequest(
                    request_id="held-too-many",
                    token_ids=[1] * (2 * BS),
                    target=pb.KVTarget(held_blocks=2, block_ids=[0], block_nbytes=1),
                ),
                timeout=10,
            )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more blocks than the prompt's cached prefix" in e.value.details()


def test_a_request_shares_the_prompt_blocks_of_one_still_decoding(cluster):
    """The prompt's full blocks enter the decode node's prefix cache once its KV is in
    place, not when the request ends: a request sharing the prefix that reserves while
    the first still decodes pins those blocks (one copy, no write of them) and gets the
    single-process reference's tokens; every block comes back after both."""
    model = LlamaModel.from_preset("tiny", seed=0)
    nodes = {n.role: n for n in status(cluster.conductor).nodes}
    d, p = nodes["decode"], nodes["prefill"]
    fp = bytes.fromhex(d.fingerprint)
    prefix = list(TOK.encode(" a system prompt held while it decodes" * 8))[: 10 * BS]
    first = prefix + list(TOK.encode(" the first user's question"))[:5]
    second = prefix + list(TOK.encode(" another user's longer question" * 2))[: BS + 3]
    with grpc.insecure_channel(d.grpc_address) as dch, grpc.insecure_channel(p.grpc_address) as pch:
        dstub, pstub = pbg.DecodeNodeStub(dch), pbg.PrefillNodeStub(pch)

        def reserve(rid: str, ids: list[int], max_tokens: int) -> pb.ReserveResponse:
            return dstub.Reserve(
                pb.ReserveRequest(
                    request_id=rid,
                    prompt_tokens=len(ids),
                    max_tokens=max_tokens,
                    block_hashes=prefix_hashes(fp, ids, BS),
                ),
                timeout=10,
            )

        def prefill(rid: str, ids: list[int], target: pb.KVTarget) -> pb.PrefillResponse:
            return pstub.Prefill(
                pb.PrefillRequest(
                    request_id=rid,
                    token_ids=ids,
                    block_hashes=prefix_hashes(fp, ids, BS),
                    target=target,
                    sampling=pb.SamplingParams(ignore_eos=True),
                ),
                timeout=60,
            )

        def decode(rid: str, ids: list[int], presp: pb.PrefillResponse, max_tokens: int):
            return dstub.Decode(
                pb.DecodeRequest(
                    request_id=rid,
                    first_token=presp.first_token,
                    max_tokens=max_tokens,
                    prompt_token_ids=ids,
                    block_hashes=prefix_hashes(fp, ids, BS),
                    sampling=pb.SamplingParams(ignore_eos=True),
                ),
                timeout=120,
            )

        long_run = 300  # decodes long after the second's Reserve
        a = reserve("held-a", first, long_run)
        assert a.cached_tokens == 0  # (a prefix no request on the node computed yet)
        a_first = prefill("held-a", first, a.target)
        a_stream = decode("held-a", first, a_first, long_run)
        a_out = [a_first.first_token, *next(a_stream).token_ids]  # it is in the batch now
        free0 = dstub.Status(pb.NodeStatusRequest(), timeout=5).kv_blocks_free
        b = reserve("held-b", second, 4)
        during = dstub.Status(pb.NodeStatusRequest(), timeout=5)
        assert during.running >= 1  # the first still decodes
        assert b.prefix_pinned and b.cached_tokens == 10 * BS
        assert b.target.held_blocks == 10 and len(b.target.block_ids) == 2
        assert free0 - during.kv_blocks_free <= 2  # its own blocks only, not a copy
        b_first = prefill("held-b", second, b.target)
        b_out = [b_first.first_token]
        for m in decode("held-b", second, b_first, 4):
            b_out.extend(m.token_ids)
        for m in a_stream:
            a_out.extend(m.token_ids)
        assert b_out == model.reference_generate(second, 4)
        assert a_out == model.reference_generate(first, long_run)
        after = dstub.Status(pb.NodeStatusRequest(), timeout=5)
        assert after.kv_blocks_free == after.kv_blocks_total  # pins and blocks all back


def test_a_reserve_the_decode_node_has_no_room_for_is_a_refusal_for_kv_room(cluster):
    """The conductor's Reserve on a decode node whose pool filled before its load report
    said so: RESOURCE_EXHAUSTED with the reason ``kv`` and a retry hint, as admission's
    own refusal for KV room (the evaluation counted these as of no known reason)."""
    import asyncio

    from kvmesh.services.conductor.frontend import Rejected
    from kvmesh.services.conductor.node_calls import NodeCalls

    d = next(n for n in status(cluster.conductor).nodes if n.role == "decode")

    async def go() -> Rejected:
        async with grpc.aio.insecure_channel(d.grpc_address) as ch:

            class View:  # the one call NodeCalls.reserve makes of the cluster view
                def decode_stub(self, n):
                    return pbg.DecodeNodeStub(ch)

            calls = NodeCalls(View(), lambda: (), 30.0)
            held = await calls.reserve(d, "room-hog", 30 * BS, 1)
            assert len(held.target.block_ids) == 31
            try:
                await calls.reserve(d, "room-late", 20 * BS, 1)
            except Rejected as e:
                return e
            finally:  # (no prefill node was asked to write them: freed at once, no fence)
                for rid in ("room-hog", "room-late"):
                    await pbg.DecodeNodeStub(ch).Release(
                        pb.ReleaseRequest(request_id=rid), metadata=((WRITERS_MD, "[]"),)
                    )
            raise AssertionError("reserved beyond the pool")

    e = asyncio.run(go())
    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(e.metadata) == {"kvmesh-reject-reason": "kv", "retry-after-ms": "500"}
    assert "could not reserve KV" in e.message and "retry after 500 ms" in e.message


def test_a_request_the_decode_node_has_no_room_for_yet_waits_for_it(cluster):
    """Through the conductor: while one request holds most of the decode node's 40 blocks,
    a second that needs more than the rest is not refused (its TTFT SLO leaves time) but
    waits until the first ends and frees them, then runs; both outputs are the
    single-process reference's."""
    import threading
    import time

    from kvmesh.loadtest.driver import KV_ROOM, diff, scrape

    model = LlamaModel.from_preset("tiny", seed=0)
    nodes = status(cluster.conductor).nodes
    _pool_idle(next(n for n in nodes if n.role == "decode").grpc_address)
    conductor_metrics = [n.metrics_address for n in nodes if n.role == "conductor"]
    assert conductor_metrics and conductor_metrics[0]
    before = scrape(conductor_metrics, want=KV_ROOM)
    first = list(TOK.encode(" the request that holds the pool" * 20))[: 25 * BS]
    second = list(TOK.encode(" the request that waits for room" * 20))[: 24 * BS]
    got: dict[str, list[int]] = {"first": [], "second": []}
    at: dict[str, float] = {}
    errors: list[BaseException] = []
    first_out = threading.Event()

    def run(name: str, ids: list[int], max_tokens: int) -> None:
        try:
            with grpc.insecure_channel(cluster.conductor) as ch:
                req = pb.GenerateRequest(
                    token_ids=ids,
                    max_tokens=max_tokens,
                    sampling=pb.SamplingParams(ignore_eos=True),
                )
                for r in pbg.ConductorStub(ch).Generate(req, timeout=120):
                    if not got[name]:
                        at[name + " first"] = time.monotonic()
                        first_out.set()
                    got[name].extend(r.token_ids)
                at[name + " last"] = time.monotonic()
        except BaseException as e:  # (re-raised below)
            errors.append(e)
            first_out.set()

    # the first: 25 prompt blocks + 80 tokens = 30 blocks; the second: 24 + 1 = 25 blocks
    a = threading.Thread(target=run, args=("first", first, 80))
    a.start()
    assert first_out.wait(60)
    b = threading.Thread(target=run, args=("second", second, 8))
    b.start()
    a.join(120)
    b.join(120)
    assert not errors, errors
    assert got["first"] == model.reference_generate(first, 80)
    assert got["second"] == model.reference_generate(second, 8)
    assert at["second first"] > at["first last"] - 0.05  # it waited for the room
    waits = diff(scrape(conductor_metrics, want=KV_ROOM), before)
    assert waits["kvmesh_kv_waits_total{cause=admission}"] == 1  # admitted to wait
    assert waits["kvmesh_kv_waits_total{cause=reserve_refused}"] == 0


def test_the_decode_nodes_load_report_counts_the_blocks_its_requests_will_grow_into(cluster):
    """The conductor books a request's KV to prompt + max_tokens, but the node takes blocks
    for the prompt at Reserve and the rest as it decodes: its load report (what admission
    reads) leaves those out of the free blocks, its status (the pool) does not."""
    d = next(n for n in status(cluster.conductor).nodes if n.role == "decode")
    _pool_idle(d.grpc_address)
    with grpc.insecure_channel(d.grpc_address) as ch:
        stub = pbg.DecodeNodeStub(ch)
        stub.Reserve(
            pb.ReserveRequest(request_id="grows", prompt_tokens=5 * BS + 3, max_tokens=64),
            timeout=10,
        )
        try:
            pool_free = stub.Status(pb.NodeStatusRequest(), timeout=5).kv_blocks_free
            stream = stub.WatchEvents(pb.WatchEventsRequest(interval_ms=50), timeout=10)
            load = next(iter(stream)).load
            stream.cancel()
            # 6 blocks taken at Reserve; prompt + max_tokens = 147 tokens = 10 blocks
            assert load.kv_blocks_free == pool_free - 4
        finally:
            stub.Release(
                pb.ReleaseRequest(request_id="grows"), timeout=5, metadata=((WRITERS_MD, "[]"),)
            )


def test_the_decode_node_numbers_its_reservations_and_its_reports_count_them(cluster):
    """Each Reserve's answer carries its ordinal on the node, one more than the last, and
    a load report made after it says the node had made that many (the conductor keeps a
    booking counted until such a report: a report made before the reservation must not
    free its blocks); a refused Reserve takes no number."""
    d = next(n for n in status(cluster.conductor).nodes if n.role == "decode")
    _pool_idle(d.grpc_address)
    with grpc.insecure_channel(d.grpc_address) as ch:
        stub = pbg.DecodeNodeStub(ch)

        def seen() -> int:
            stream = stub.WatchEvents(pb.WatchEventsRequest(interval_ms=50), timeout=10)
            load = next(iter(stream)).load
            stream.cancel()
            return load.reserves_seen

        def reserve(rid: str, tokens: int) -> pb.ReserveResponse:
            return stub.Reserve(
                pb.ReserveRequest(request_id=rid, prompt_tokens=tokens, max_tokens=4),
                timeout=10,
            )

        try:
            before = seen()
            a = reserve("numbered-a", 2 * BS)
            assert a.reserve_seq > before > 0  # (0 would say: not numbered)
            assert seen() == a.reserve_seq
            with pytest.raises(grpc.RpcError) as e:  # more blocks than the pool has
                reserve("numbered-big", 45 * BS)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            b = reserve("numbered-b", BS)
            assert b.reserve_seq == a.reserve_seq + 1
            assert seen() == b.reserve_seq
        finally:
            for rid in ("numbered-a", "numbered-b"):
                stub.Release(
                    pb.ReleaseRequest(request_id=rid), timeout=5, metadata=((WRITERS_MD, "[]"),)
                )
