"""Local clusters: ``kvmesh up`` and the integration tests start etcd and the four services
as real processes on this machine with :class:`LocalCluster`."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.client import cluster_status, format_status, stream_completion


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Etcd:
    """A single-member etcd on loopback with its own data dir (kept across restarts)."""

    def __init__(
        self, data_dir: str, client_port: int = 0, peer_port: int = 0, log_path: str | None = None
    ) -> None:
        self.data_dir = data_dir
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 20) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError(
                "etcd is not on PATH: install it (Debian: apt-get install etcd-server)"
            )
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [
                binary,
                "--name",
                "kvmesh",
                "--data-dir",
                self.data_dir,
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"kvmesh={peer}",
                "--log-level",
                "error",
                # a single member: elect itself fast after a restart
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {self.proc.returncode} (log: {self.log_path})"
                )
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if b"true" in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"etcd did not become healthy in {timeout}s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


class LocalCluster:
    """etcd (unless ``etcd_endpoint`` is given) + store-master + conductor + nodes, each a
    ``python -m kvmesh.services.cli <role>`` process with its log in ``workdir``."""

    def __init__(
        self,
        workdir: str | None = None,
        *,
        cluster: str = "default",
        prefill: int = 1,
        decode: int = 1,
        conductor_port: int = 0,
        etcd_endpoint: str | None = None,
        lease_ttl: int = 10,
        node_args: list[str] | None = None,
        conductor_args: list[str] | None = None,
        decode_args: list[str] | None = None,
        store_args: list[str] | None = None,
        log_level: str = "INFO",
        http_port: int = 0,
        tls: bool = False,
        api_key: str = "",
    ) -> None:
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="kvmesh-")
        Path(self.workdir).mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.n_prefill, self.n_decode = prefill, decode
        self.conductor_port = conductor_port or free_port()
        self.lease_ttl = lease_ttl
        self.node_args = node_args or []
        self.decode_args = decode_args or []  # after node_args, for decode nodes only
        seg = (
            self.node_args[self.node_args.index("--segment-memory") + 1]
            if "--segment-memory" in self.node_args
            else "1"
        )
        self.expect_store = seg.strip() not in ("0", "0B", "0MiB")
        self.conductor_args = conductor_args or []
        self.store_args = store_args or []
        self.log_level = log_level
        self.http_port = (
            http_port  # conductor's OpenAI-compatible API (0 = any free port, -1 = off)
        )
        # tls: a throwaway CA + one certificate per service in <workdir>/tls (mutual TLS on
        # every gRPC channel); api_key: what status()/wait_ready() send to the conductor
        self.tls_dir = os.path.join(self.workdir, "tls") if tls else ""
        self.api_key = api_key
        self._pki: dict = {}
        self.etcd = (
            None
            if etcd_endpoint
            else Etcd(
                os.path.join(self.workdir, "etcd"), log_path=os.path.join(self.workdir, "etcd.log")
            )
        )
        self.etcd_endpoint = etcd_endpoint or self.etcd.endpoint
        self.procs: dict[str, subprocess.Popen] = {}
        self._stopped: set[str] = set()
        self._spawn_args: dict[str, tuple[str, list[str]]] = {}

    @property
    def conductor(self) -> str:
        return f"127.0.0.1:{self.conductor_port}"

    def _common(self, name: str) -> list[str]:
        return [
            "--cluster",
            self.cluster,
            "--etcd",
            self.etcd_endpoint,
            "--node-id",
            name,
            "--lease-ttl",
            str(self.lease_ttl),
            "--log-level",
            self.log_level,
            *self.tls_args(name),
        ]

    def tls_args(self, name: str) -> list[str]:
        """``--tls-cert/--tls-key/--tls-ca`` of ``name`` ("client" for CLIs); [] without TLS."""
        if not self.tls_dir:
            return []
        if not self._pki:
            from kvmesh.services.common.pki import DevCA

            self._ca = DevCA(self.tls_dir)
            self._pki["client"] = self._ca.issue("client")
        if name not in self._pki:
            self._pki[name] = self._ca.issue(name)
        ident = self._pki[name]
        return ["--tls-cert", ident.cert, "--tls-key", ident.key, "--tls-ca", ident.ca]

    def client_tls(self):
        """The client identity (a ``channels.TlsFiles``), or None without TLS."""
        from kvmesh.services.common.channels import TlsFiles

        if not self.tls_dir:
            return None
        a = self.tls_args("client")
        return TlsFiles(a[1], a[3], a[5])

    def spawn(self, name: str, role: str, extra: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.workdir, f"{name}.log"), "ab")
        p = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.services.cli", role, *self._common(name), *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.procs[name] = p
        self._spawn_args[name] = (role, list(extra))
        self._stopped.discard(name)
        return p

    def start(self, timeout: float = 90) -> LocalCluster:
        if self.etcd:
            self.etcd.start()
        self.spawn("store-master-0", "store-master", self.store_args)
        self.spawn(
            "conductor-0",
            "conductor",
            [
                "--port",
                str(self.conductor_port),
                "--http-port",
                str(self.http_port),
                *self.conductor_args,
            ],
        )
        for i in range(self.n_prefill):
            self.spawn(f"prefill-{i}", "prefill", self.node_args)
        for i in range(self.n_decode):
            self.spawn(f"decode-{i}", "decode", self.node_args + self.decode_args)
        self.wait_ready(timeout)
        return self

    def status(self, timeout: float = 2):
        return asyncio.run(
            cluster_status(self.conductor, timeout, api_key=self.api_key, tls=self.client_tls())
        )

    def wait_ready(
        self, timeout: float = 90, prefill: int | None = None, decode: int | None = None
    ) -> None:
        want_p = self.n_prefill if prefill is None else prefill
        want_d = self.n_decode if decode is None else decode
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None and name not in self._stopped:
                    raise RuntimeError(
                        f"{name} exited with {p.returncode}; see "
                        f"{os.path.join(self.workdir, name + '.log')}"
                    )
            try:
                s = self.status()
                roles = [n.role for n in s.nodes if n.reachable]
                last = f"{roles}"
                if (
                    roles.count("prefill") == want_p
                    and roles.count("decode") == want_d
                    and "store-master" in roles
                    and (s.store_bytes_total > 0 or not self.expect_store)
                ):
                    return
            except Exception as e:  # not up yet
                last = str(e)[:200]
            time.sleep(0.25)
        raise RuntimeError(
            f"cluster not ready in {timeout}s (last: {last}); logs in {self.workdir}"
        )

    def stop_process(self, name: str, sig: int = signal.SIGTERM, wait: float = 30) -> int:
        p = self.procs[name]
        self._stopped.add(name)
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(wait)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return p.returncode

    def restart_process(
        self, name: str, sig: int = signal.SIGTERM, down_s: float = 0.0
    ) -> subprocess.Popen:
        """Stops ``name`` with ``sig`` (if it still runs), waits ``down_s``, and spawns it
        again with the same role and arguments (same ports where they were fixed, e.g.
        the conductor's)."""
        self.stop_process(name, sig)
        if down_s > 0:
            time.sleep(down_s)
        role, extra = self._spawn_args[name]
        return self.spawn(name, role, extra)

    def stop(self) -> None:
        order = (
            [n for n in self.procs if n.startswith(("prefill", "decode"))]
            + [n for n in self.procs if n.startswith("conductor")]
            + [n for n in self.procs if n.startswith("store-master")]
        )
        for name in order:
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for name in order:
            p = self.procs[name]
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.etcd:
            self.etcd.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=50051, help="conductor gRPC port")
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="conductor's OpenAI-compatible HTTP API port (falls back to any free "
        "port when 8000 is taken; 0 = any free port, -1 = off)",
    )
    p.add_argument("--prefill", type=int, default=1, help="number of prefill nodes")
    p.add_argument("--decode", type=int, default=1, help="number of decode nodes")
    p.add_argument("--model", default="tiny", help="model preset for every node")
    p.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    p.add_argument(
        "--workdir", default=None, help="where logs and etcd data go (default: a temp dir)"
    )
    p.add_argument(
        "--demo",
        default=None,
        metavar="PROMPT",
        help="serve this one prompt, print the completion, and stop",
    )
    p.add_argument("--max-tokens", type=int, default=48, help="tokens for --demo")
    p.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS on every gRPC channel: generates a throwaway CA and one "
        "certificate per service (and 'client' for CLIs) into <workdir>/tls",
    )
    p.add_argument(
        "--api-keys",
        default="",
        help="client API keys of the conductor "
        "(KEY, KEY:TENANT, KEY:TENANT:shared=NS, "
        "comma-separated); empty = open",
    )


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


def up(args: argparse.Namespace) -> int:
    cluster = LocalCluster(
        args.workdir,
        prefill=args.prefill,
        decode=args.decode,
        conductor_port=args.port,
        http_port=_http_port(args.http_port),
        node_args=["--model", args.model, "--block-size", str(args.block_size)],
        tls=getattr(args, "tls", False),
        conductor_args=(["--api-keys", args.api_keys] if getattr(args, "api_keys", "") else None),
        api_key=(getattr(args, "api_keys", "") or "").split(",")[0].split(":")[0],
    )
    client = " ".join(cluster.tls_args("client")) if cluster.tls_dir else ""
    client += f" --api-key {cluster.api_key}" if cluster.api_key else ""
    stop = {"now": False}

    def on_signal(signum, frame):
        if stop["now"]:
            return
        stop["now"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        print(
            f"starting etcd, store-master, conductor, {args.prefill} prefill and "
            f"{args.decode} decode node(s); logs in {cluster.workdir}",
            flush=True,
        )
        t0 = time.monotonic()
        cluster.start()
        print(
            f"cluster ready in {time.monotonic() - t0:.1f}s: conductor at {cluster.conductor}, "
            f"etcd at {cluster.etcd_endpoint}",
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
            print(
                f"OpenAI-compatible API: http://{http}/v1 (e.g. curl http://{http}/v1/models)",
                flush=True,
            )
        print(
            f'try: kvmesh generate --conductor {cluster.conductor}{" " + client if client else ""} "Hello"\n'
            f"     kvmesh status --conductor {cluster.conductor}{' ' + client if client else ''}\n"
            f"Ctrl-C stops the cluster.",
            flush=True,
        )
        while True:
            time.sleep(1)
            for name, p in cluster.procs.items():
                if p.poll() is not None:
                    print(f"{name} exited with {p.returncode}; stopping", file=sys.stderr)
                    return 1
    except KeyboardInterrupt:
        print("\nstopping the cluster", flush=True)
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
