"""``kvmesh up``: a whole cluster on this machine, from the command line to Ctrl-C.

The life of one ``kvmesh up``: ``services.cli`` parses its flags with
:func:`add_up_arguments` and calls :func:`up`. :func:`up` resolves ``--model`` (a bad one,
or a hub id to download, is dealt with before etcd starts), checks that the conductor's
port is free, and builds a :class:`~kvmesh.services.launcher.cluster.LocalCluster`
(``--http-port`` 8000 falls back to a free port when taken). ``LocalCluster.start`` starts
etcd, the store-master(s), the conductor(s) and the nodes as processes tied to this one,
reads the conductors' ports from etcd and waits until every node is reachable. Then
either ``--demo`` streams one completion and returns, or :func:`up` prints how to reach
the cluster and waits while the cluster's supervisor restarts a service that dies; it
returns 1 when supervision gives up. SIGINT, SIGTERM or SIGHUP stop the cluster in order
(``LocalCluster.stop``); a second signal during the teardown SIGKILLs every process."""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
import time

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.client import format_status, stream_completion
from kvmesh.services.common import cpu_budget
from kvmesh.services.common.argtypes import PORT, float_at_least, int_at_least, int_in
from kvmesh.services.common.channels import PortInUse, check_port
from kvmesh.services.launcher.cluster import LocalCluster
from kvmesh.services.launcher.workdir_lock import WorkdirInUse


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--port", type=PORT, default=50051, help="conductor gRPC port (0 = any free port)"
    )
    p.add_argument(
        "--http-port",
        type=int_in(-1, 65535, "0 = any free port, -1 = off"),
        default=8000,
        help="conductor's OpenAI-compatible HTTP API port (falls back to any free "
        "port when 8000 is taken; 0 = any free port, -1 = off)",
    )
    p.add_argument("--prefill", type=int_at_least(1), default=1, help="number of prefill nodes")
    p.add_argument("--decode", type=int_at_least(1), default=1, help="number of decode nodes")
    p.add_argument(
        "--store-masters",
        type=int_at_least(1),
        default=1,
        help="store-masters: one leads, the others stand by and take over when its "
        "etcd lease lapses",
    )
    p.add_argument(
        "--conductors",
        type=int_at_least(1),
        default=1,
        help="conductors serving at once (active-active; each counts the others' work "
        "through the nodes' load reports); the first on --port/--http-port, the others "
        "on free ports",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model of every node: a preset (tiny, small, medium, demo), a Hugging Face model "
        "directory or hub id (org/name); default: demo with --demo, else tiny",
    )
    p.add_argument(
        "--nodes",
        type=int_at_least(0, "0 = --prefill and --decode say"),
        default=0,
        help="model nodes in all, split into prefill and decode by --ratio (instead of "
        "--prefill/--decode)",
    )
    p.add_argument(
        "--ratio",
        default="",
        help="with --nodes: P:D (e.g. 2:2), or auto: the planner's pick for --workload "
        "at --cpus per node and SLOs of TTFT 2 s / TBT 150 ms (kvmesh plan; the model's "
        "costs are measured first)",
    )
    p.add_argument(
        "--workload",
        default="",
        help="Mooncake-format trace (JSON Lines) that --ratio auto plans for",
    )
    p.add_argument("--block-size", type=int_in(1, 4096), default=64, help="tokens per KV block")
    p.add_argument(
        "--cpus",
        type=float_at_least(0, hi=1024),
        default=0.0,
        help="CPU budget of each prefill and decode node in cores, a fraction allowed "
        "(0.375): each runs in a cgroup of its own with that CFS quota and ceil(cpus) "
        "torch threads; where cgroups cannot be written (not root, no cpu controller) "
        "a warning, and the nodes run unbudgeted; 0 = none",
    )
    p.add_argument(
        "--workdir", default=None, help="where logs and etcd data go (default: a temp dir)"
    )
    p.add_argument(
        "--demo",
        default=None,
        metavar="PROMPT",
        help="serve this one prompt, print the completion, and stop",
    )
    p.add_argument("--max-tokens", type=int_in(1, 2**31 - 1), default=48, help="tokens for --demo")
    p.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS on every gRPC channel: generates a throwaway CA and one "
        "certificate per service (and 'client' for CLIs) into <workdir>/tls",
    )
    p.add_argument(
        "--max-restarts",
        type=int_at_least(0, "0 = stop the cluster when any process dies"),
        default=5,
        help="a service (or etcd) that dies is restarted, after a backoff doubling from "
        "0.5 s, at most this many times within --restart-window; then the cluster stops "
        "(0 = stop the cluster when any process dies)",
    )
    p.add_argument(
        "--restart-window",
        type=float_at_least(0, above=True),
        default=60.0,
        help="seconds over which --max-restarts counts a service's restarts",
    )
    p.add_argument(
        "--api-keys",
        default="",
        help="client API keys of the conductor "
        "(KEY, KEY:TENANT, KEY:TENANT:shared=NS, "
        "comma-separated); empty = open",
    )
    # vllm serve's habits (the conductor's and the nodes' options of the same names)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the conductor's gRPC and HTTP API ports bind (0.0.0.0 = every "
        "address; it is registered as 127.0.0.1 then); the other services stay on loopback",
    )
    p.add_argument("--api-key", default="", help="one client API key (as an --api-keys entry)")
    p.add_argument(
        "--served-model-name",
        default="",
        help="names clients may call the model by, comma-separated (the conductor's option)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="longest context a request may use, prompt plus max_tokens (0 = the model's)",
    )
    p.add_argument(
        "--dtype",
        default="",
        help="the nodes' compute dtype: auto, bfloat16, float16 (CUDA only) or float32 "
        "(default: the nodes' own default, float32)",
    )


def vllm_style_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(conductor, node) arguments for ``kvmesh up``'s vllm-style flags."""
    from kvmesh.services.common.settings import is_wildcard

    conductor: list[str] = []
    host = getattr(args, "host", "127.0.0.1") or "127.0.0.1"
    if host != "127.0.0.1":
        conductor += ["--host", host]
        if is_wildcard(host):
            conductor += ["--advertise-host", "127.0.0.1"]
    for flag in ("api_keys", "api_key", "served_model_name", "max_model_len"):
        value = getattr(args, flag, "")
        if value:
            conductor += ["--" + flag.replace("_", "-"), str(value)]
    dtype = getattr(args, "dtype", "")
    return conductor, (["--dtype", dtype] if dtype else [])


def _http_port(port: int) -> int:
    """The default 8000 if free, else any free port (a second local cluster still starts)."""
    if port != 8000:
        return port
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        return port
    except OSError:
        print(
            "port 8000 is taken: the HTTP API gets a free port (see kvmesh status)",
            file=sys.stderr,
            flush=True,
        )
        return 0


def node_split(args: argparse.Namespace, model: str) -> tuple[int, int] | None:
    """(prefill, decode) nodes from ``--nodes`` and ``--ratio`` (None without ``--nodes``):
    ``P:D`` as given, ``auto`` the planner's pick for ``--workload`` (printed with its
    table). Raises ValueError saying what to fix."""
    nodes = getattr(args, "nodes", 0) or 0
    ratio = (getattr(args, "ratio", "") or "").strip()
    if not nodes:
        if ratio:
            raise ValueError("--ratio needs --nodes N (the model nodes to split)")
        return None
    if nodes < 2:
        raise ValueError(f"--nodes {nodes}: a split needs at least 2 (one prefill, one decode)")
    if ratio in ("", "auto") and not getattr(args, "workload", ""):
        raise ValueError("--nodes with --ratio auto (the default) needs --workload FILE")
    if ratio and ratio != "auto":
        try:
            p, d = (int(x) for x in ratio.split(":"))
        except ValueError:
            raise ValueError(f"--ratio {ratio!r}: give P:D (e.g. 2:2) or auto") from None
        if p < 1 or d < 1 or p + d != nodes:
            raise ValueError(f"--ratio {ratio}: P and D >= 1 with P + D = --nodes ({nodes})")
        return p, d
    from kvmesh.services.planner import WorkloadStats, plan
    from kvmesh.services.planner.measure import measure_costs

    cpus = float(getattr(args, "cpus", 0.0) or 0.0) or 1.0
    print(f"planning the split: measuring {model} at {cpus:g} cores ...", flush=True)
    costs = measure_costs(model, "float32", args.block_size, cpus=cpus, kv_memory="256MiB")
    try:
        stats = WorkloadStats.from_trace(
            args.workload, block_size=args.block_size, local_cache_tokens=costs.pool_tokens
        )
    except (OSError, KeyError) as e:
        raise ValueError(f"--workload {args.workload}: {e}") from None
    result = plan(costs, stats, nodes, cpus, 2.0, 0.15)
    print(result.format_table(), flush=True)
    return result.pick


def up(args: argparse.Namespace) -> int:
    model = getattr(args, "model", None) or ("tiny" if args.demo is None else "demo")
    try:  # a bad --model fails before etcd starts; a hub id is downloaded once, here
        from kvmesh.services.engine.model_spec import CheckpointError, resolve_model

        resolve_model(model)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    cpus = float(getattr(args, "cpus", 0.0) or 0.0)
    if cpus < 0:
        print(f"error: --cpus {cpus:g} must be >= 0 (0 = no budget)", file=sys.stderr)
        return 1
    if cpus > 0:
        why = cpu_budget.support()
        if why:
            print(f"warning: --cpus {cpus:g} ignored, nodes run unbudgeted: {why}", file=sys.stderr)
            cpus = 0.0
    try:
        split = node_split(args, model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if split is not None:
        args.prefill, args.decode = split
    if args.port:  # before etcd starts: a second cluster must not share the port
        try:
            check_port(f"{getattr(args, 'host', '') or '127.0.0.1'}:{args.port}")
        except PortInUse as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    try:
        cluster = _cluster(args, model, cpus)
    except WorkdirInUse as e:  # nothing in that workdir was touched
        print(f"error: {e}", file=sys.stderr)
        return 1
    client = " ".join(cluster.tls_args("client")) if cluster.tls_dir else ""
    client += f" --api-key {cluster.api_key}" if cluster.api_key else ""
    return _run(args, cluster, client)


def _cluster(args: argparse.Namespace, model: str, cpus: float) -> LocalCluster:
    """The cluster ``kvmesh up`` runs; raises WorkdirInUse when another holds --workdir."""
    conductor_args, dtype_args = vllm_style_args(args)
    return LocalCluster(
        args.workdir,
        prefill=args.prefill,
        decode=args.decode,
        store_masters=getattr(args, "store_masters", 1),
        conductors=getattr(args, "conductors", 1),
        conductor_port=args.port,
        http_port=_http_port(args.http_port),
        node_args=["--model", model, "--block-size", str(args.block_size), *dtype_args],
        tls=getattr(args, "tls", False),
        conductor_args=conductor_args,
        api_key=getattr(args, "api_key", "")
        or (getattr(args, "api_keys", "") or "").split(",")[0].split(":")[0],
        max_restarts=getattr(args, "max_restarts", 5),
        restart_window_s=getattr(args, "restart_window", 60.0),
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
        cpus=cpus,
    )


def starting_line(cluster: LocalCluster) -> str:
    """What ``kvmesh up`` prints as it starts ``cluster``: what it starts, and how many."""

    def some(n: int, what: str) -> str:
        return what if n == 1 else f"{n} {what}s"

    return (
        f"starting etcd, {some(cluster.n_store_masters, 'store-master')}, "
        f"{some(cluster.n_conductors, 'conductor')}, {cluster.n_prefill} prefill and "
        f"{cluster.n_decode} decode node(s); logs in {cluster.workdir}"
    )


def _run(args: argparse.Namespace, cluster: LocalCluster, client: str) -> int:
    """Starts ``cluster`` and serves until a signal, the demo's end or a failure."""
    stop = {"now": False}

    def on_signal(signum, frame):
        if stop["now"]:  # a second signal while stopping: no waiting for anyone
            print("\nkilling the cluster's processes", file=sys.stderr, flush=True)
            cluster.kill()
            return
        stop["now"] = True
        raise KeyboardInterrupt

    # SIGINT too: a shell starts a background job with SIGINT ignored, and Python then
    # leaves it ignored; `kill -INT` must stop the cluster all the same
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        print(starting_line(cluster), flush=True)
        t0 = time.monotonic()
        cluster.start()
        etcd_auth = (
            f" (TLS, user {cluster.etcd_user}, password in {cluster.workdir}/etcd-password)"
            if cluster.etcd_password
            else ""
        )
        print(
            f"cluster ready in {time.monotonic() - t0:.1f}s: conductor at "
            f"{','.join(cluster.conductors)}, "
            f"etcd at {cluster.etcd_endpoint}{etcd_auth}",
            flush=True,
        )
        print(format_status(cluster.status()), flush=True)
        if args.demo is not None:
            print(f"\n>>> {args.demo}", flush=True)
            req = pb.GenerateRequest(  # what `kvmesh generate` sends by default
                prompt=args.demo,
                max_tokens=args.max_tokens,
                sampling=pb.SamplingParams(temperature=0.0, seed=0),
                slo=pb.SLO(ttft_ms=0.0),
            )
            return asyncio.run(
                stream_completion(
                    cluster.conductor,
                    req,
                    api_key=cluster.api_key,
                    tls=cluster.client_tls(),
                    verbose=True,
                )
            )
        http = next((n.http_address for n in cluster.status().nodes if n.http_address), "")
        if http:
            # with TLS the conductor's HTTP API is HTTPS, with a certificate of this CA
            url = f"https://{http}" if cluster.tls_dir else f"http://{http}"
            ca = f"--cacert {cluster.tls_dir}/ca.pem " if cluster.tls_dir else ""
            print(
                f"OpenAI-compatible API: {url}/v1 (e.g. curl {ca}{url}/v1/models)",
                flush=True,
            )
        print(
            f'try: kvmesh generate --conductor {cluster.conductor}{" " + client if client else ""} "Hello"\n'
            f"     kvmesh status --conductor {cluster.conductor}{' ' + client if client else ''}\n"
            f"The nodes' data-plane secret is in {cluster.workdir}/secret: a node started by "
            f"hand joins with KVMESH_SECRET=$(cat {cluster.workdir}/secret).\n"
            f"Ctrl-C stops the cluster.",
            flush=True,
        )
        while True:  # the cluster's supervisor restarts a service that dies
            time.sleep(0.5)
            failure = cluster.failure()
            if failure:  # supervision logged why it gave up already: say it once
                said = failure == cluster.gave_up
                print(
                    "stopping the cluster" if said else f"{failure}; stopping the cluster",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
    except KeyboardInterrupt:
        print("\nstopping the cluster", flush=True)
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        stop["now"] = True  # from here a signal hurries the teardown, never cuts it short
        cluster.stop()
