"""A prefill retried on another node after the first node failed gets a reservation of
its own: the conductor gives back the failed attempt's decode reservation (naming the
failed node as its writer, so the decode node fences those blocks) and reserves afresh
under a per-attempt id, which the retry's prefill node writes and the decode node
decodes. The client sees its own request id and the right tokens throughout.

With the old retry (same reservation, same id), the failed node's late writes, or its
late "KV ready" notice, could land in blocks the retry owns; here that shows as the
retry reusing the first attempt's id and blocks.

A real cluster (etcd, two prefill nodes and a decode node in their own processes, the
tiny model, disaggregated route): the prefill nodes hold requests at the "prefilling"
stage through their test-only hook (``KVMESH_TEST_HOLD_PREFILL``), the node holding the
first attempt is killed, and the retry is held in turn on the other node. The decode
node's fence is an hour, so the first attempt's blocks stay out of use for the test."""

from __future__ import annotations

import signal
import uuid

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, node, start_with_hold_hook
from tests.test_cancel import Hold, free_blocks, long_prompt, wait_free

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    hold_dir = str(tmp_path_factory.mktemp("hold"))
    c = LocalCluster(
        str(tmp_path_factory.mktemp("cluster")),
        prefill=2,
        node_args=NODE_ARGS,
        conductor_args=DISAGG_ONLY,
        decode_args=["--fence-s", "3600"],
    )
    start_with_hold_hook(c, hold_dir)
    c.hold_dir = hold_dir  # type: ignore[attr-defined]
    yield c
    c.stop()


def prefill_free(c: LocalCluster) -> dict[str, int]:
    out = {}
    for n in ("prefill-0", "prefill-1"):
        st = node(c.conductor, n)
        assert st.reachable, f"{n} did not answer the status call (a loaded box?)"
        out[n] = st.kv_blocks_free
    return out


def test_a_retried_prefill_gets_a_fresh_reservation_under_its_own_id(cluster):
    hold = Hold.cleared(cluster.hold_dir)
    prompt = long_prompt()
    ids = TOK.encode(prompt)
    want = LlamaModel.from_preset("tiny", seed=0).reference_generate(ids, 4, eos_id=TOK.eos_id)
    before, pools = free_blocks(cluster), prefill_free(cluster)
    client_id = f"client-{uuid.uuid4().hex[:6]}"
    hold.at("prefilling")
    try:
        with grpc.insecure_channel(cluster.conductor) as ch:
            call = pbg.ConductorStub(ch).Generate(
                pb.GenerateRequest(prompt=prompt, max_tokens=4, request_id=client_id),
                timeout=120,
            )
            hold.wait_held(1, call)
            first_id = hold.held()[0].split()[1]
            reserved = before - free_blocks(cluster)  # one attempt's reservation
            assert reserved >= len(ids) // 16
            # the node computing it has taken blocks of its pool for the prompt
            now = prefill_free(cluster)
            victim = next(n for n in pools if now[n] < pools[n])
            survivor = next(n for n in pools if n != victim)
            cluster.stop_process(victim, signal.SIGKILL)
            hold.wait_held(2, call)  # the retry, held on the other node
            retry_id = hold.held()[1].split()[1]
            assert first_id.startswith(client_id)
            assert retry_id != first_id and retry_id.startswith(first_id)
            # the first attempt's blocks are fenced (its node may still write them), the
            # retry's are its own: two reservations' worth out of the pool, not one
            assert free_blocks(cluster) == before - 2 * reserved
            hold.at("")
            responses = list(call)
    finally:
        hold.at("")
    assert {r.request_id for r in responses} == {client_id}
    route = next(r.route for r in responses if r.HasField("route"))
    assert route.prefill_node == survivor
    assert [t for r in responses for t in r.token_ids] == want
    # the retry's blocks come back when it ends; the failed attempt's stay fenced
    assert wait_free(cluster, before - reserved) == before - reserved
