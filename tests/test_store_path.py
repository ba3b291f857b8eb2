"""The cluster store path: blocks one prefill node computed are put into the store off
the TTFT path; another prefill node pulls them over the transfer engine instead of
recomputing them, and the decode node's output is still exactly the reference."""

from __future__ import annotations

import time

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common.hashing import prefix_hashes
from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, generate, status

BS = 16
SHARED = "A long shared system prompt that both requests start with, block by block. " * 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("store")),
        prefill=2,
        decode=1,
        node_args=NODE_ARGS,
        conductor_args=DISAGG_ONLY,
    )
    c.start()
    yield c
    c.stop()


def test_second_prefill_node_fetches_prefix_from_store(cluster):
    tok = ByteTokenizer()
    model = LlamaModel.from_preset("tiny", seed=0)
    first = generate(cluster.conductor, SHARED + "one", max_tokens=2)
    producer = first.route.prefill_node
    deadline = time.monotonic() + 10
    while status(cluster.conductor).store_blocks == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    s = status(cluster.conductor)
    assert s.store_blocks >= len(tok.encode(SHARED)) // BS
    nodes = {n.node_id: n for n in s.nodes}
    other = next(n for n in nodes.values() if n.role == "prefill" and n.node_id != producer)
    decode = next(n for n in nodes.values() if n.role == "decode")

    tokens = tok.encode(SHARED + "two, with another ending")
    hashes = prefix_hashes(bytes.fromhex(other.fingerprint), tokens, BS)
    rid, max_tokens = "store-path-1", 12
    with (
        grpc.insecure_channel(decode.grpc_address) as dch,
        grpc.insecure_channel(other.grpc_address) as pch,
    ):
        dstub, pstub = pbg.DecodeNodeStub(dch), pbg.PrefillNodeStub(pch)
        target = dstub.Reserve(
            pb.ReserveRequest(request_id=rid, prompt_tokens=len(tokens), max_tokens=max_tokens),
            timeout=5,
        ).target
        resp = pstub.Prefill(
            pb.PrefillRequest(request_id=rid, token_ids=tokens, block_hashes=hashes, target=target),
            timeout=30,
        )
        shared_blocks = len(tok.encode(SHARED)) // BS
        assert resp.cached_tokens == 0
        assert resp.fetched_tokens == shared_blocks * BS
        assert resp.computed_tokens == len(tokens) - resp.fetched_tokens
        out = [resp.first_token]
        for d in dstub.Decode(
            pb.DecodeRequest(request_id=rid, first_token=resp.first_token, max_tokens=max_tokens),
            timeout=30,
        ):
            out.extend(d.token_ids)
    assert out == model.reference_generate(tokens, max_tokens, eos_id=tok.eos_id)
    after = {n.node_id: n for n in status(cluster.conductor).nodes}
    assert after[other.node_id].fetched_tokens_total == shared_blocks * BS
