"""Local clusters: ``kvmesh up`` and the integration tests start etcd and the four services
as real processes on this machine with :class:`LocalCluster`."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.client import cluster_status, format_status, stream_completion
from kvmesh.services.common.etcd import EtcdClient, EtcdError
from kvmesh.services.common.registry import node_key
from kvmesh.services.common.settings import KNOWN_SECRETS

T = TypeVar("T")

ETCD_BIND_ATTEMPTS = 5


def _unused_port() -> int:
    """A port no socket holds right now. It is only a guess: another process may take it
    before etcd binds it, hence :meth:`Etcd.start` retrying with other ports. The services
    themselves bind port 0 and report the port the kernel gave them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_ports(pid: int) -> set[int] | None:
    """The TCP ports process ``pid`` listens on (Linux ``/proc``), or None where that
    cannot be read."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        inodes = set()
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        ports = set()
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{table}") as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                        ports.add(int(cols[1].rsplit(":", 1)[1], 16))
        return ports
    except OSError:
        return None


class _PortTaken(RuntimeError):
    """etcd could not bind its client or peer port: another process holds it."""


class Etcd:
    """A single-member etcd with its own data dir (kept across restarts).

    It listens for clients on ``host`` (loopback by default) and for its peer on
    loopback. etcd cannot bind port 0 and report the port it got, so ports left at 0 are
    picked here; when etcd then fails to bind one (another process took it meanwhile),
    the first :meth:`start` tries again with other ports. Restarts keep the ports."""

    def __init__(
        self,
        data_dir: str,
        client_port: int = 0,
        peer_port: int = 0,
        log_path: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.data_dir = data_dir
        self.host = host
        self._pick_client, self._pick_peer = not client_port, not peer_port
        self.client_port = client_port or _unused_port()
        self.peer_port = peer_port or _unused_port()
        self.log_path = log_path or f"{data_dir.rstrip('/')}.log"
        self.proc: subprocess.Popen | None = None
        self._started = False

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self, timeout: float = 20) -> None:
        """Starts etcd and waits until it answers ``/health``; raises RuntimeError."""
        can_repick = not self._started and (self._pick_client or self._pick_peer)
        attempts = ETCD_BIND_ATTEMPTS if can_repick else 1
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(timeout)
                self._started = True
                return
            except _PortTaken as e:
                if attempt == attempts:
                    raise RuntimeError(
                        f"{e} ({attempt} attempt(s); log: {self.log_path})"
                    ) from None
                if self._pick_client:
                    self.client_port = _unused_port()
                if self._pick_peer:
                    self.peer_port = _unused_port()

    def _start_once(self, timeout: float) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError(
                "etcd is not on PATH: install it (Debian: apt-get install etcd-server)"
            )
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            log_start = out.tell()
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
                code = self.proc.returncode
                self.proc = None
                if "address already in use" in self._log_since(log_start):
                    raise _PortTaken(f"etcd could not bind {client} or {peer}: address in use")
                raise RuntimeError(f"etcd exited with {code} (log: {self.log_path})")
            if self._healthy(client):
                ports = listening_ports(self.proc.pid)
                if ports is None or self.client_port in ports:
                    return
                # /health was answered by whoever else holds the port; ours will exit
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy in {timeout}s (log: {self.log_path})")

    @staticmethod
    def _healthy(client: str) -> bool:
        try:
            with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                return b"true" in r.read()
        # refused, reset, timed out, an HTTP error status, or not HTTP at all
        except (OSError, http.client.HTTPException):
            return False

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

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


CONDUCTOR = "conductor-0"


def cluster_secret(workdir: str) -> str:
    """The data-plane secret of a local cluster: the operator's ``KVMESH_SECRET`` when it is
    set (and not one of the well-known ones), else a random one for this cluster. It is
    written to ``<workdir>/secret`` (mode 0600), so a node started by hand can join:
    ``KVMESH_SECRET=$(cat <workdir>/secret) kvmesh prefill ...``."""
    given = os.environ.get("KVMESH_SECRET", "")
    secret = given if given and given not in KNOWN_SECRETS else secrets.token_hex(32)
    path = os.path.join(workdir, "secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


class LocalCluster:
    """etcd (unless ``etcd_endpoint`` is given) + store-master + conductor + nodes, each a
    ``python -m kvmesh.services.cli <role>`` process with its log in ``workdir``.

    Every service binds port 0 unless told a port (``conductor_port``, ``http_port``) and
    registers its addresses in etcd; :meth:`start` reads the conductor's from there, and
    a restarted conductor gets the same ports again. The nodes share a data-plane secret
    (:attr:`secret`, given to them as ``KVMESH_SECRET``): see :func:`cluster_secret`."""

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
        self.conductor_port = conductor_port  # 0 until start() reads the bound port
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
        # the conductor's OpenAI-compatible API (0 = any free port, read by start(); -1 = off)
        self.http_port = http_port
        self.secret = cluster_secret(self.workdir)  # the nodes' data-plane secret
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
        self._etcd_endpoint = etcd_endpoint or ""
        self.procs: dict[str, subprocess.Popen] = {}
        self._stopped: set[str] = set()
        self._spawn_args: dict[str, tuple[str, list[str]]] = {}

    @property
    def etcd_endpoint(self) -> str:
        return self._etcd_endpoint or (self.etcd.endpoint if self.etcd else "")

    @property
    def conductor(self) -> str:
        if not self.conductor_port:
            raise RuntimeError("the conductor's port is known once the cluster has started")
        return f"127.0.0.1:{self.conductor_port}"

    def env(self) -> dict[str, str]:
        """The environment of the cluster's processes (one started by hand too)."""
        return {**os.environ, "PYTHONUNBUFFERED": "1", "KVMESH_SECRET": self.secret}

    def common_args(self, name: str) -> list[str]:
        """The flags every service ``name`` of this cluster takes (cluster, etcd, node id,
        lease, log level, TLS identity): for a process started by hand beside it."""
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

    def respawn(self, name: str) -> subprocess.Popen:
        """Starts ``name`` again with the role and arguments it was last spawned with."""
        role, extra = self._spawn_args[name]
        return self.spawn(name, role, extra)

    def spawn(self, name: str, role: str, extra: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.workdir, f"{name}.log"), "ab")
        p = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.services.cli", role, *self.common_args(name), *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env(),
        )
        self.procs[name] = p
        self._spawn_args[name] = (role, list(extra))
        self._stopped.discard(name)
        return p

    def start(self, timeout: float = 90) -> LocalCluster:
        deadline = time.monotonic() + timeout
        if self.etcd:
            self.etcd.start()
        self.spawn("store-master-0", "store-master", self.store_args)
        # a registration left by an earlier conductor-0 (kept etcd data, an etcd of our
        # caller) must not be read as this one's address
        self._etcd_call(lambda etcd: etcd.delete(self._conductor_key()))
        self.spawn(
            CONDUCTOR,
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
        self._read_conductor_ports(deadline - time.monotonic())
        self.wait_ready(max(1.0, deadline - time.monotonic()))
        return self

    def _conductor_key(self) -> str:
        return node_key(self.cluster, "conductor", CONDUCTOR)

    def _etcd_call(self, fn: Callable[[EtcdClient], Awaitable[T]]) -> T:
        async def run() -> T:
            async with EtcdClient(self.etcd_endpoint) as etcd:
                return await fn(etcd)

        return asyncio.run(run())

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None and name not in self._stopped:
                raise RuntimeError(
                    f"{name} exited with {p.returncode}; see "
                    f"{os.path.join(self.workdir, name + '.log')}"
                )

    def _read_conductor_ports(self, timeout: float) -> None:
        """Reads the ports the conductor bound from its etcd registration, and pins them
        for its restarts (clients keep its address)."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            try:
                raw = self._etcd_call(lambda etcd: etcd.get(self._conductor_key()))
            except EtcdError:  # etcd not answering yet
                raw = None
            if raw is not None:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the conductor did not register in etcd in {timeout:.0f}s; "
                    f"logs in {self.workdir}"
                )
            time.sleep(0.1)
        info = json.loads(raw)
        self.conductor_port = int(info["grpc"].rsplit(":", 1)[1])
        if self.http_port == 0 and info.get("http"):
            self.http_port = int(info["http"].rsplit(":", 1)[1])
        role, extra = self._spawn_args[CONDUCTOR]
        pinned = {"--port": self.conductor_port, "--http-port": self.http_port}
        extra = [
            str(pinned[extra[i - 1]]) if i and extra[i - 1] in pinned else a
            for i, a in enumerate(extra)
        ]
        self._spawn_args[CONDUCTOR] = (role, extra)

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
            self._check_alive()
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
            except grpc.RpcError as e:  # not up yet
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
            f"The nodes' data-plane secret is in {cluster.workdir}/secret: a node started by "
            f"hand joins with KVMESH_SECRET=$(cat {cluster.workdir}/secret).\n"
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
