"""``kvmesh``: one command line for the cluster.

kvmesh up                      etcd + store-master + conductor + prefill + decode here
kvmesh conductor|store-master|prefill|decode [--help]   one service
kvmesh generate "text"         stream a completion from a running cluster
kvmesh status [--once|--watch] [--json]   the nodes, load and latency (live on a TTY)
kvmesh health HOST:PORT        exit 0 when that service's gRPC health is SERVING
kvmesh plan --workload FILE --nodes N --cpus F   the prefill:decode split to run
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import signal
import sys
import time

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.client import (
    cluster_status,
    conductor_addresses,
    format_endpoints,
    format_status,
    stream_completion,
)
from kvmesh.services.common.argtypes import float_at_least as _float_at_least
from kvmesh.services.common.argtypes import int_in as _int_in
from kvmesh.services.common.auth import api_key_from_env
from kvmesh.services.common.channels import TlsFiles, configure
from kvmesh.services.common.config import ConfigError

DEFAULT_CONDUCTOR = "127.0.0.1:50051"


ENGINE_MISSING = (
    "the model engine is not installed (torch is missing): the prefill and decode nodes "
    "need it; install it with: pip install 'kvmesh[engine]'"
)


def _service_main(role: str):
    if role == "conductor":
        from kvmesh.services.conductor.server import main
    elif role == "store-master":
        from kvmesh.services.store_master.server import main
    else:
        try:
            if role == "prefill":
                from kvmesh.services.prefill.server import main
            else:
                from kvmesh.services.decode.server import main
        except ModuleNotFoundError as e:
            if e.name not in ("torch", "safetensors"):
                raise
            raise ConfigError(ENGINE_MISSING) from None
    return main


def _exit_after_shutdown() -> None:
    """Ends a service's process once its graceful shutdown is done (deregistered, drained,
    servers stopped, etcd closed, telemetry flushed) the way a normal exit begins - thread
    pools told to end and threads that are not daemons joined (``threading._shutdown``),
    ``atexit`` handlers run (logging's flush among them), stdio flushed - and then
    ``os._exit(0)``, without the interpreter's teardown of its modules: with torch loaded
    that takes 1-3 s more of CPU, for nothing a service still needs, at every stop of a
    node (a local cluster's stop waits for it)."""
    import atexit
    import os
    import threading

    getattr(threading, "_shutdown", lambda: None)()
    getattr(atexit, "_run_exitfuncs", lambda: None)()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe or file: nothing more to say
            pass
    os._exit(0)


async def _generate(args: argparse.Namespace) -> int:
    req = pb.GenerateRequest(
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        model=args.model,
        # no --seed: fresh randomness (the conductor draws one)
        sampling=pb.SamplingParams(temperature=args.temperature, seed=args.seed),
        slo=pb.SLO(ttft_ms=args.ttft_slo_ms),
        cache_salt=args.cache_salt,
    )
    return await stream_completion(
        args.conductor, req, timeout=args.timeout, api_key=args.api_key, verbose=args.verbose
    )


async def _status(args: argparse.Namespace) -> int:
    live = args.watch or (not args.once and not args.json and sys.stdout.isatty())
    if not live:
        return await _status_frames(args, live)
    # Ctrl-C / SIGTERM end the refreshes wherever they are (a call in flight included),
    # at once: through the loop's own handler, which wakes it even when the signal lands
    # on one of grpc's threads
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await _status_frames(args, live)
    except asyncio.CancelledError:
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _status_frames(args: argparse.Namespace, live: bool) -> int:
    from google.protobuf.json_format import MessageToDict

    while True:
        try:
            s = await cluster_status(args.conductor, api_key=args.api_key)
        except grpc.aio.AioRpcError as e:
            msg = f"error: cannot reach the conductor at {args.conductor}: {e.code().name}"
            if not live:
                print(msg, file=sys.stderr)
                return 1
            text = msg
        else:
            if args.json:
                text = json.dumps(MessageToDict(s, preserving_proto_field_name=True), indent=2)
            else:
                text = format_status(s)
                if live:
                    text += "\n\n" + format_endpoints(s)
        if not live:
            print(text)
            return 0
        stamp = time.strftime("%H:%M:%S")
        sys.stdout.write(
            ("\x1b[H\x1b[2J" if sys.stdout.isatty() else "")
            + f"kvmesh status  {args.conductor}  {stamp}  (every {args.interval:g}s;"
            f" Ctrl-C quits)\n\n{text}\n"
        )
        sys.stdout.flush()
        await asyncio.sleep(args.interval)


async def _health(args: argparse.Namespace) -> int:
    from kvmesh.services.common.health import wait_serving

    ok, last = await wait_serving(args.address, args.service, timeout=args.wait)
    if not args.quiet:
        print(f"{args.address}: {last}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def _conductors(text: str) -> str:
    """An argparse type: one conductor address or several, comma-separated (checked by
    ``client.conductor_addresses``: an empty list or a malformed address is an error
    naming it, not a traceback)."""
    try:
        conductor_addresses(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_client_arguments(p: argparse.ArgumentParser, api_key: bool = True) -> None:
    """TLS (and API key) options of a client command. The TLS defaults are the
    ``KVMESH_TLS_*`` variables the services read, so a command run beside a service in
    its environment (a systemd unit's ``ExecStartPost=kvmesh health``) speaks TLS as it."""
    env = TlsFiles.from_env()
    p.add_argument(
        "--tls-ca",
        default=env.ca,
        help="CA certificate (PEM) to verify the server (turns TLS on; default: $KVMESH_TLS_CA)",
    )
    p.add_argument(
        "--tls-cert",
        default=env.cert,
        help="client certificate (PEM) for mutual TLS (default: $KVMESH_TLS_CERT)",
    )
    p.add_argument(
        "--tls-key",
        default=env.key,
        help="private key (PEM) of --tls-cert (default: $KVMESH_TLS_KEY)",
    )
    p.add_argument(
        "--tls-server-name",
        default=env.server_name,
        help="name to check in the server's certificate instead of its address "
        "(default: $KVMESH_TLS_SERVER_NAME)",
    )
    if api_key:
        p.add_argument(
            "--api-key",
            default=api_key_from_env(),
            help="API key sent as 'authorization: Bearer' (default: $KVMESH_API_KEY)",
        )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    roles = ("conductor", "store-master", "prefill", "decode")
    if argv and argv[0] in roles:
        try:
            _service_main(argv[0])(argv[1:])
        except ConfigError as e:  # a bad option: its message, not a traceback
            sys.exit(f"kvmesh {argv[0]}: error: {e}")
        _exit_after_shutdown()
    parser = argparse.ArgumentParser(
        prog="kvmesh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    for role in roles:
        sub.add_parser(role, help=f"run one {role} service (see kvmesh {role} --help)")
    up_parser = sub.add_parser("up", help="run a whole cluster on this machine")
    if argv and argv[0] == "up":  # the launcher (etcd client, process control) only for up
        from kvmesh.services.launcher import add_up_arguments

        add_up_arguments(up_parser)
    g = sub.add_parser("generate", help="stream a completion from a running cluster")
    g.add_argument("prompt")
    g.add_argument(
        "--conductor",
        type=_conductors,
        default=DEFAULT_CONDUCTOR,
        help="conductor host:port, or several comma-separated (tried in turn while one is down)",
    )
    g.add_argument("--max-tokens", type=_int_in(1, 2**31 - 1), default=32)
    g.add_argument("--model", default="")
    g.add_argument("--temperature", type=_float_at_least(0), default=0.0)
    g.add_argument(
        "--seed",
        type=_int_in(0, 2**64 - 1),
        default=None,
        help="RNG seed (0 to 2^64-1); none: fresh randomness for each request",
    )
    g.add_argument(
        "--ttft-slo-ms", type=_float_at_least(0), default=0.0, help="tighten the TTFT SLO"
    )
    g.add_argument("--cache-salt", default="", help="tenant salt for prefix hashes")
    g.add_argument("--timeout", type=_float_at_least(0, above=True), default=300.0)
    g.add_argument("-v", "--verbose", action="store_true", help="print usage to stderr")
    add_client_arguments(g)
    st = sub.add_parser("status", help="list the nodes and their state")
    st.add_argument(
        "--conductor",
        type=_conductors,
        default=DEFAULT_CONDUCTOR,
        help="conductor host:port[,host:port...]",
    )
    st.add_argument("--json", action="store_true", help="machine-readable output")
    add_client_arguments(st)
    st.add_argument(
        "--once",
        action="store_true",
        help="print once and exit (default when stdout is not a terminal)",
    )
    st.add_argument(
        "--watch", action="store_true", help="refresh until interrupted (default on a terminal)"
    )
    st.add_argument(
        "--interval",
        type=_float_at_least(0, above=True),
        default=2.0,
        help="seconds between refreshes",
    )
    h = sub.add_parser("health", help="check a service's gRPC health (exit 0 when SERVING)")
    h.add_argument("address", help="host:port of any kvmesh service's gRPC port")
    h.add_argument("--service", default="", help="service name to check ('' = the server)")
    h.add_argument(
        "--wait",
        type=_float_at_least(0),
        default=0.0,
        help="keep checking up to this many seconds until SERVING",
    )
    h.add_argument("-q", "--quiet", action="store_true")
    add_client_arguments(h, api_key=False)
    pl = sub.add_parser("plan", help="predict each prefill:decode split's capacity, pick one")
    if argv and argv[0] == "plan":
        from kvmesh.services.planner.command import add_plan_arguments

        add_plan_arguments(pl)
    args = parser.parse_args(argv)
    if hasattr(args, "tls_ca"):
        try:
            configure(TlsFiles(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name))
        except ValueError as e:
            parser.error(str(e))
    if args.cmd == "up":
        if importlib.util.find_spec("torch") is None:  # its nodes would fail one by one
            parser.error(ENGINE_MISSING)
        from kvmesh.services.launcher import up

        sys.exit(up(args))
    if args.cmd == "generate":
        sys.exit(asyncio.run(_generate(args)))
    if args.cmd == "health":
        sys.exit(asyncio.run(_health(args)))
    if args.cmd == "plan":
        from kvmesh.services.planner.command import run as run_plan

        sys.exit(run_plan(args))
    try:
        sys.exit(asyncio.run(_status(args)))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
