"""The committed protobuf/gRPC stubs must match what ``python -m kvmesh.protos.gen`` produces."""

from pathlib import Path

import pytest

from kvmesh.protos import gen


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("protos-gen")
    gen.generate(out)
    return out


def test_protos_found():
    protos = {p.as_posix() for p in gen.proto_files()}
    assert {"protos/etcd/rpc.proto", "protos/etcd/kv.proto", "protos/etcd/auth.proto"} <= protos


@pytest.mark.parametrize("rel", gen.generated_files(), ids=lambda p: p.as_posix())
def test_stub_is_fresh(fresh: Path, rel: Path):
    committed = gen.ROOT / rel
    assert committed.exists(), f"{rel} missing: run `python -m kvmesh.protos.gen`"
    assert committed.read_bytes() == (fresh / rel).read_bytes(), (
        f"{rel} is stale: run `python -m kvmesh.protos.gen`"
    )


def test_no_unexpected_stubs(fresh: Path):
    produced = {p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file()}
    assert produced == set(gen.generated_files())
