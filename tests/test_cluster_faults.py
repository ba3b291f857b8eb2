"""Nodes leaving (SIGTERM, SIGKILL) and etcd restarting under a running cluster."""

from __future__ import annotations

import signal
import time

import pytest

from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import NODE_ARGS, generate, status

TTL = 3


def live(conductor: str) -> set[str]:
    return {n.node_id for n in status(conductor).nodes}


def wait_until(pred, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"condition not met within {timeout}s")


@pytest.fixture(scope="module")
def expected():
    model, tok = LlamaModel.from_preset("tiny", seed=0), ByteTokenizer()
    return lambda p, n=8: model.reference_generate(tok.encode(p), n, eos_id=tok.eos_id)


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(str(tmp_path), prefill=2, decode=2, lease_ttl=TTL, node_args=NODE_ARGS)
    c.start()
    yield c
    c.stop()


@pytest.mark.parametrize("victims", [("prefill-1", "decode-1")])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_stopped_node_leaves_within_ttl_and_requests_succeed(cluster, expected, victims, sig):
    for victim in victims:
        assert victim in live(cluster.conductor)
        cluster.stop_process(victim, sig)
        # SIGTERM deregisters at once; SIGKILL leaves when the lease expires
        took = wait_until(lambda: victim not in live(cluster.conductor), TTL + 3)
        assert took <= TTL + 3
    for i in range(4):
        prompt = f"after the loss, request {i}"
        assert generate(cluster.conductor, prompt, max_tokens=8).tokens == expected(prompt)


def test_etcd_restart_services_reregister(cluster, expected):
    names = live(cluster.conductor)
    assert {"prefill-0", "prefill-1", "decode-0", "decode-1", "store-master-0"} <= names
    cluster.etcd.stop()
    time.sleep(TTL + 1)  # long enough for every lease to expire
    cluster.etcd.start()
    wait_until(lambda: live(cluster.conductor) >= names, 20)
    cluster.wait_ready(20)
    for i in range(3):
        prompt = f"after etcd came back, request {i}"
        assert generate(cluster.conductor, prompt, max_tokens=8).tokens == expected(prompt)
