"""Helpers for tests that drive a real cluster over gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg

NODE_ARGS = ["--block-size", "16", "--kv-memory", "16MiB", "--segment-memory", "16MiB"]
# every request takes the disaggregated route (prefill node -> decode node)
DISAGG_ONLY = ["--colocate-below-tokens", "0", "--direct-share", "1.0"]


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: pb.Usage | None = None
    route: pb.Route | None = None


def generate(conductor: str, prompt: str = "", *, timeout: float = 60, **kw) -> Result:
    """Runs one Generate to the end; raises grpc.RpcError on a status."""
    req = pb.GenerateRequest(prompt=prompt, **kw)
    out = Result()
    with grpc.insecure_channel(conductor) as ch:
        for r in pbg.ConductorStub(ch).Generate(req, timeout=timeout):
            out.tokens.extend(r.token_ids)
            out.text += r.text
            if r.HasField("route"):
                out.route = r.route
            if r.finish_reason:
                out.finish_reason = r.finish_reason
                out.usage = r.usage
    return out


def status(conductor: str) -> pb.ClusterStatusResponse:
    with grpc.insecure_channel(conductor) as ch:
        return pbg.ConductorStub(ch).ClusterStatus(pb.ClusterStatusRequest(), timeout=5)


def node(conductor: str, node_id: str) -> pb.NodeStatus:
    return next(n for n in status(conductor).nodes if n.node_id == node_id)


def start_with_hold_hook(c, hold_dir: str) -> None:
    """Starts LocalCluster ``c`` with the prefill node's test hook on
    (``KVMESH_TEST_HOLD_PREFILL``: idle until a test writes a stage to
    ``<hold_dir>/hold``, see tests.test_cancel.Hold). Only the cluster's processes see the
    variable; a failed start stops what it started."""
    import os

    old = os.environ.get("KVMESH_TEST_HOLD_PREFILL")
    os.environ["KVMESH_TEST_HOLD_PREFILL"] = hold_dir
    try:
        c.start()
    except BaseException:
        c.stop()
        raise
    finally:
        if old is None:
            del os.environ["KVMESH_TEST_HOLD_PREFILL"]
        else:
            os.environ["KVMESH_TEST_HOLD_PREFILL"] = old
