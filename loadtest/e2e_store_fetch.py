"""One end-to-end run of the store's remote path as the nodes use it (issue 13, part 3).

A local cluster (etcd, conductor, store-master, two prefill nodes, one decode node, each
model node lending a segment) computes a prompt's prefix on one prefill node, which puts
its blocks into the store; then the other prefill node is given prompts sharing that
prefix and pulls the blocks from the store instead of recomputing them. For each fetch
the node reports (bytes, ms from the prefix lookup to the last byte in its pool) in its
WatchEvents load report, the figures the conductor's fetch-versus-recompute decision now
learns the store path's cost from (``services/conductor/store_fetch.py``).

Right after each fetch, this process runs the benchmark's operation on the same blocks of
the same store (``prefix_len`` then ``get_into``, as the node does, from a client lending
nothing): the fetched tokens' transfer time should match it. It prints both, the fitted
fetch model, and what the engine's raw bandwidth would have predicted instead, and writes
them to ``loadtest/results/store_fetch_e2e.json``.

    python -m kvmesh.loadtest.e2e_store_fetch [--prefixes 8,32,96] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
from typing import Any

import grpc
import numpy as np

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common.hashing import prefix_hashes
from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.conductor.store_fetch import StoreFetchModel
from kvmesh.services.launcher import LocalCluster

BS = 16
NODE_ARGS = ["--block-size", str(BS), "--kv-memory", "64MiB", "--segment-memory", "64MiB"]
DISAGG_ONLY = ["--colocate-below-tokens", "0", "--direct-share", "1.0"]
OUT = os.path.join(os.path.dirname(__file__), "results", "store_fetch_e2e.json")


class Watch:
    """Collects a prefill node's reported store fetches and engine bandwidths."""

    def __init__(self, address: str) -> None:
        self.fetches: list[tuple[int, float]] = []
        self.engine_bw: list[float] = []
        self._ch = grpc.insecure_channel(address)
        self._stream = pbg.PrefillNodeStub(self._ch).WatchEvents(
            pb.WatchEventsRequest(interval_ms=50)
        )
        self._lock = threading.Lock()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        try:
            for ev in self._stream:
                with self._lock:
                    self.fetches += [(f.bytes, f.ms) for f in ev.load.store_fetches]
                    self.engine_bw += [bw for bw in ev.load.bandwidth_bytes_per_s.values() if bw]
        except grpc.RpcError:
            pass

    def wait(self, n: int, timeout: float = 10) -> list[tuple[int, float]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.fetches) >= n:
                    return list(self.fetches)
            time.sleep(0.05)
        raise TimeoutError(f"the node reported {len(self.fetches)} fetch(es), not {n}")

    def close(self) -> None:
        self._stream.cancel()
        self._ch.close()


async def bench_fetch(c: LocalCluster, hashes: list[bytes], nbytes: int, reps: int) -> list[float]:
    """ms of ``prefix_len`` + ``get_into`` of ``hashes`` (the node's fetch) from a client in
    this process that lends nothing; every byte read is compared with the first read."""
    from kvmesh.rdma import TransferEngine
    from kvmesh.services.common.etcd import EtcdClient
    from kvmesh.services.common.registry import Membership, nodes_prefix
    from kvmesh.services.store.client import StoreClient

    etcd = EtcdClient(c.etcd_endpoint)
    members = Membership(etcd, nodes_prefix("default"))
    await members.start()
    te = TransferEngine(c.secret.encode(), poll_us=0)
    await te.start()
    cl = StoreClient(te, members, "e2e-bench")
    buf = np.zeros(nbytes, dtype=np.uint8)
    rid = te.register(buf)
    each = nbytes // len(hashes)
    ms: list[float] = []
    first = None
    try:
        for _ in range(reps):
            buf[:] = 0
            t = time.perf_counter()
            n = await cl.prefix_len(hashes)
            got = await cl.get_into(hashes[:n], rid, [i * each for i in range(n)])
            ms.append((time.perf_counter() - t) * 1e3)
            if n != len(hashes) or any(g != each for g in got):
                raise RuntimeError(f"bench read {n} of {len(hashes)} blocks: {got}")
            if first is None:
                first = buf.copy()
            elif not np.array_equal(first, buf):
                raise RuntimeError("bench read different bytes than before")
    finally:
        te.unregister(rid)
        await cl.close()
        await te.close()
        await members.stop()
        await etcd.close()
    return ms


def run(prefixes: list[int], reps: int, out: str) -> dict:
    tok = ByteTokenizer()
    work = tempfile.mkdtemp(prefix="kvmesh-e2e-fetch-")
    c = LocalCluster(
        work,
        prefill=2,
        decode=1,
        node_args=NODE_ARGS,
        conductor_args=DISAGG_ONLY,
        log_level="WARNING",
    )
    c.start()
    rows: list[dict[str, Any]] = []
    watches: dict[str, Watch] = {}
    try:
        s = c.status()
        prefill = [n for n in s.nodes if n.role == "prefill"]
        decode = next(n for n in s.nodes if n.role == "decode")
        watches.update({n.node_id: Watch(n.grpc_address) for n in prefill})
        time.sleep(0.3)
        with grpc.insecure_channel(c.conductor) as cch:
            conductor = pbg.ConductorStub(cch)
            for k, blocks in enumerate(prefixes):
                # a prefix of `blocks` full blocks, its own per row (nothing shared between rows)
                shared = (f"row {k}: " + "the shared context of a long agent session. " * 99)[
                    : blocks * BS
                ]
                route = None
                for r in conductor.Generate(
                    pb.GenerateRequest(prompt=shared + "one", max_tokens=1), timeout=120
                ):
                    if r.HasField("route"):
                        route = r.route
                assert route is not None, "the conductor sent no route"
                producer = route.prefill_node
                other = next(n for n in prefill if n.node_id != producer)
                watch = watches[other.node_id]
                tokens = tok.encode(shared + " two, another ending")
                hashes = prefix_hashes(bytes.fromhex(other.fingerprint), tokens, BS)[:blocks]
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    st = c.status()
                    if st.store_blocks >= sum(prefixes[: k + 1]):
                        break
                    time.sleep(0.1)
                seen = len(watch.fetches)
                rid = f"e2e-fetch-{k}"
                with (
                    grpc.insecure_channel(decode.grpc_address) as dch,
                    grpc.insecure_channel(other.grpc_address) as pch,
                ):
                    dstub, pstub = pbg.DecodeNodeStub(dch), pbg.PrefillNodeStub(pch)
                    target = dstub.Reserve(
                        pb.ReserveRequest(request_id=rid, prompt_tokens=len(tokens), max_tokens=1),
                        timeout=10,
                    ).target
                    all_hashes = prefix_hashes(bytes.fromhex(other.fingerprint), tokens, BS)
                    resp = pstub.Prefill(
                        pb.PrefillRequest(
                            request_id=rid, token_ids=tokens, block_hashes=all_hashes, target=target
                        ),
                        timeout=120,
                    )
                    dstub.Release(pb.ReleaseRequest(request_id=rid), timeout=10)
                if resp.fetched_tokens != blocks * BS:
                    raise RuntimeError(
                        f"row {k}: the node fetched {resp.fetched_tokens} tokens, not {blocks * BS}"
                    )
                nbytes, node_ms = watch.wait(seen + 1)[seen]
                bench_ms = asyncio.run(bench_fetch(c, hashes, nbytes, reps))
                p50 = statistics.median(bench_ms)
                row: dict[str, Any] = {
                    "blocks": blocks,
                    "tokens": blocks * BS,
                    "bytes": nbytes,
                    "node_ms": node_ms,
                    "bench_ms_p50": p50,
                    "bench_ms": bench_ms,
                    "ratio": node_ms / p50,
                }
                rows.append(row)
                print(
                    f"{blocks:>4} blocks {nbytes / 2**20:7.2f} MiB: node fetch {node_ms:7.2f} ms "
                    f"({nbytes / node_ms / 1e6:5.2f} GB/s), bench prefix_len+get_into p50 "
                    f"{p50:7.2f} ms ({nbytes / p50 / 1e6:5.2f} "
                    f"GB/s): ratio {row['ratio']:.2f}",
                    flush=True,
                )
    finally:
        for w in watches.values():
            w.close()
        c.stop()
    model = StoreFetchModel()
    for r in rows[1:]:  # the first fetch also opens the connections: a warm-up
        model.observe(r["bytes"], r["node_ms"])
    bws = [bw for w in watches.values() for bw in w.engine_bw]
    engine = statistics.median(bws) / 1e3 if bws else 0.0
    for r in rows:
        r["model_ms"] = model.predict_ms(r["bytes"], 1.0)
        r["engine_ms"] = r["bytes"] / engine if engine else None
    res = {
        "topology": "LocalCluster on loopback: 2 prefill, 1 decode, store-master; the store "
        "holds the blocks in the producer prefill node's segment, the fetching node reads "
        "them over the transfer engine (TCP)",
        "rows": rows,
        "model": {"fixed_ms": model.fixed_ms, "bytes_per_ms": model.bytes_per_ms},
        "engine_bytes_per_ms": engine,
        "unix_time": time.time(),
        "note": "row 0 is a warm-up (it opens the connections), left out of the model; "
        "node_ms: the fetch as the node reported it to the conductor (lookup to last "
        "byte in its pool); bench_ms: prefix_len + get_into of the same blocks from a client "
        "in this process, right after; the machine is shared and noisy",
    }
    print(
        f"fitted store path: {model.fixed_ms:.2f} ms + bytes / {model.bytes_per_ms / 1e6:.3f} "
        f"GB/s; the engine's measured bandwidth (node reports): {engine / 1e6:.3f} GB/s"
    )
    for r in rows:
        eng = f"{r['engine_ms']:.2f} ms" if r["engine_ms"] else "n/a"
        print(
            f"  {r['blocks']:>4} blocks: measured {r['node_ms']:.2f} ms, store model "
            f"{r['model_ms']:.2f} ms, engine bandwidth would say {eng}"
        )
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--prefixes",
        default="4,8,32,96,8,32,96",
        help="prefix lengths, in blocks (the first is a warm-up, left out of the fit)",
    )
    ap.add_argument("--reps", type=int, default=5, help="bench reads per prefix")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args(argv)
    run([int(x) for x in a.prefixes.split(",")], a.reps, a.out)


if __name__ == "__main__":
    main()
