"""``kvmesh``: one command line for the cluster.

  kvmesh up                      etcd + store-master + conductor + prefill + decode here
  kvmesh conductor|store-master|prefill|decode [--help]   one service
  kvmesh generate "text"         stream a completion from a running cluster
  kvmesh status [--json]         the nodes and their state
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from protos import kvmesh_pb2 as pb
from protos import kvmesh_pb2_grpc as pbg

DEFAULT_CONDUCTOR = "127.0.0.1:50051"


def _service_main(role: str):
    if role == "conductor":
        from services.conductor.server import main
    elif role == "store-master":
        from services.store_master.server import main
    elif role == "prefill":
        from services.prefill.server import main
    else:
        from services.decode.server import main
    return main


async def _generate(args: argparse.Namespace) -> int:
    req = pb.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, model=args.model,
                             sampling=pb.SamplingParams(temperature=args.temperature,
                                                        seed=args.seed),
                             slo=pb.SLO(ttft_ms=args.ttft_slo_ms), cache_salt=args.cache_salt)
    async with grpc.aio.insecure_channel(args.conductor) as ch:
        try:
            last = None
            async for r in pbg.ConductorStub(ch).Generate(req, timeout=args.timeout):
                sys.stdout.write(r.text)
                sys.stdout.flush()
                last = r
            sys.stdout.write("\n")
            if last is not None and args.verbose:
                u = last.usage
                print(f"[{last.finish_reason}] prompt={u.prompt_tokens} completion="
                      f"{u.completion_tokens} cached={u.cached_tokens} computed={u.computed_tokens}",
                      file=sys.stderr)
        except grpc.aio.AioRpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


async def cluster_status(conductor: str, timeout: float = 5) -> pb.ClusterStatusResponse:
    async with grpc.aio.insecure_channel(conductor) as ch:
        return await pbg.ConductorStub(ch).ClusterStatus(pb.ClusterStatusRequest(),
                                                          timeout=timeout)


def format_status(s: pb.ClusterStatusResponse) -> str:
    rows = [f"cluster {s.cluster}: {len(s.nodes)} node(s); store {s.store_blocks} block(s), "
            f"{s.store_bytes_used / 2**20:.1f}/{s.store_bytes_total / 2**20:.1f} MiB",
            f"{'ROLE':<13} {'NODE':<28} {'GRPC':<22} {'KV FREE/TOTAL':>14} {'QUEUE':>6} "
            f"{'RUN':>4} {'COMPUTED':>9} {'CACHED':>8} {'FETCHED':>8} {'DECODED':>8}"]
    for n in sorted(s.nodes, key=lambda n: (n.role, n.node_id)):
        kv = f"{n.kv_blocks_free}/{n.kv_blocks_total}" if n.kv_blocks_total else "-"
        state = "" if n.reachable else " (unreachable)"
        rows.append(f"{n.role:<13} {n.node_id[:28]:<28} {n.grpc_address:<22} {kv:>14} "
                    f"{n.queue_depth:>6} {n.running:>4} {n.computed_tokens_total:>9} "
                    f"{n.cached_tokens_total:>8} {n.fetched_tokens_total:>8} "
                    f"{n.generated_tokens_total:>8}{state}")
    return "\n".join(rows)


async def _status(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    try:
        s = await cluster_status(args.conductor)
    except grpc.aio.AioRpcError as e:
        print(f"error: cannot reach the conductor at {args.conductor}: {e.code().name}",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(MessageToDict(s, preserving_proto_field_name=True), indent=2))
    else:
        print(format_status(s))
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    roles = ("conductor", "store-master", "prefill", "decode")
    if argv and argv[0] in roles:
        _service_main(argv[0])(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for role in roles:
        sub.add_parser(role, help=f"run one {role} service (see kvmesh {role} --help)")
    from services.launcher import add_up_arguments

    add_up_arguments(sub.add_parser("up", help="run a whole cluster on this machine"))
    g = sub.add_parser("generate", help="stream a completion from a running cluster")
    g.add_argument("prompt")
    g.add_argument("--conductor", default=DEFAULT_CONDUCTOR, help="conductor host:port")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--model", default="")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ttft-slo-ms", type=float, default=0.0, help="tighten the TTFT SLO")
    g.add_argument("--cache-salt", default="", help="tenant salt for prefix hashes")
    g.add_argument("--timeout", type=float, default=300.0)
    g.add_argument("-v", "--verbose", action="store_true", help="print usage to stderr")
    st = sub.add_parser("status", help="list the nodes and their state")
    st.add_argument("--conductor", default=DEFAULT_CONDUCTOR, help="conductor host:port")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.cmd == "up":
        from services.launcher import up

        sys.exit(up(args))
    if args.cmd == "generate":
        sys.exit(asyncio.run(_generate(args)))
    sys.exit(asyncio.run(_status(args)))


if __name__ == "__main__":
    main()
