"""Short cases of the fault suite (the long ones: ``python -m kvmesh.loadtest.faults``): a decode
node SIGKILLed mid-load, a conductor restart mid-load, and KV bytes flipped on the data
plane with integrity checking on. Each runs under a steady load of greedy requests whose
outputs are known; no wrong token, no hung request, every request ends with its output
or a retriable status, and the cluster recovers within the lease TTL + a few seconds."""

from __future__ import annotations

import signal

import pytest

from kvmesh.loadtest import faults as F
from kvmesh.services.launcher import LocalCluster

pytestmark = pytest.mark.timeout(240)

PLAN = F.Plan(before_s=2.0, after_s=7.0, concurrency=3, max_tokens=8, deadline_s=20.0)


@pytest.fixture(scope="module")
def workload():
    prompts = F.make_prompts(12)
    return prompts, F.expected_outputs(prompts, PLAN.max_tokens)


def check(row: dict) -> None:
    print(F.fmt_row(row))
    assert row["requests"] >= 10, row
    assert row["wrong"] == 0, row
    assert row["hung"] == 0, row
    assert row["failed_other"] == 0, row
    assert row["completed"] + row["failed_retriable"] == row["requests"], row
    assert row["ok_after_recovery"] > 0, row


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(
        str(tmp_path_factory.mktemp("faults")),
        prefill=2,
        decode=2,
        lease_ttl=F.TTL,
        node_args=F.NODE_ARGS,
        conductor_args=F.DISAGG_ONLY,
        log_level="WARNING",
    )
    c.start(120)
    yield c
    c.stop()


def test_decode_node_sigkill_mid_load(cluster, workload):
    prompts, expect = workload
    row = F.run_fault(
        cluster,
        "sigkill-decode",
        prompts,
        expect,
        PLAN,
        lambda ld, res: F.fault_kill(cluster, ld, PLAN, "decode-1", res),
    )
    check(row)
    assert row["cluster_whole_s"] is not None and row["cluster_whole_s"] <= F.TTL + 3
    assert row["last_failure_s"] <= F.TTL + 5
    assert row["failed_retriable"] == 0  # retries within the deadline absorb the loss


def test_conductor_restart_mid_load(cluster, workload):
    prompts, expect = workload
    row = F.run_fault(
        cluster,
        "conductor-restart",
        prompts,
        expect,
        PLAN,
        lambda ld, res: F.fault_restart(cluster, ld, PLAN, "conductor-0", res, signal.SIGKILL),
    )
    check(row)
    assert row["cluster_whole_s"] is not None
    assert row["failed_retriable"] == 0


def test_kv_byte_flip_is_detected_and_recomputed(tmp_path, workload):
    prompts, expect = workload
    row = F.byte_flip(str(tmp_path), prompts, expect, PLAN, every=20)
    check(row)
    assert row["checksum_failures_logged"] > 0, row  # damage happened and was caught
    assert row["failed_retriable"] == 0


def test_conductor_killed_row_judges_accepted_requests_by_ttft_and_tpot():
    """The SLO check of the conductor-killed row (faults_conductor.slo_check): a request
    meets it when its TTFT and its mean time per output token are within bounds, and
    the counts are split at the fault."""
    from kvmesh.loadtest.fault_harness import Req
    from kvmesh.loadtest.faults_conductor import slo_check, tpot_ms

    def req(t_start, ttft_s, gaps, outcome="ok"):
        return Req(0, t_start, 25.0, outcome=outcome, ttft_s=ttft_s, tbt_s=gaps)

    reqs = [
        req(1.0, 0.050, [0.004, 0.006]),  # meets both (TPOT 5 ms)
        req(2.0, 0.150, [0.004]),  # TTFT over
        req(6.0, 0.050, [0.001, 0.039]),  # one long gap, TPOT 20 ms: over
        req(7.0, 0.080, [0.010, 0.001, 0.001]),  # a long gap, but TPOT 4 ms: meets
        req(8.0, 0.010, [0.001], outcome="failed"),  # not accepted: not counted
    ]
    assert tpot_ms(reqs[0]) == pytest.approx(5.0)
    out = slo_check(reqs, t_fault=5.0, ttft_slo_ms=100.0, tpot_slo_ms=10.0)
    assert out["accepted"] == 4
    assert (out["accepted_within_slo"], out["accepted_outside_slo"]) == (2, 2)
    assert out["within_ttft_slo"] == 3
    assert out["within_slo_before_fault"] == "1/2"
    assert out["within_slo_after_fault"] == "1/2"
    assert out["accepted_ttft_max_ms"] == 150.0
