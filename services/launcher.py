"""Local clusters: ``kvmesh up`` and the integration tests start etcd and the four services
as real processes on this machine with :class:`LocalCluster`."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.children import kill_all, spawn_tied, terminate_all
from kvmesh.services.client import cluster_status, format_status, stream_completion
from kvmesh.services.common.channels import PortInUse, check_port
from kvmesh.services.common.etcd import EtcdClient, EtcdError, etcd_credentials
from kvmesh.services.common.registry import node_key
from kvmesh.services.common.settings import KNOWN_SECRETS

T = TypeVar("T")

ETCD_BIND_ATTEMPTS = 5
_log = logging.getLogger(__name__)


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


def _last_error(log_path: str) -> str:
    """``: <the last "error: ..." line>`` of a service's log (why it exited), or ""."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - 16384))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):  # services.run / cli: "[kvmesh <role>: ]error: <why>"
        m = re.match(r"(?:kvmesh [\w-]+: )?error: (.+)", line)
        if m:
            return ": " + m.group(1)
    return ""


class _PortTaken(RuntimeError):
    """etcd could not bind its client or peer port: another process holds it."""


class Etcd:
    """A single-member etcd with its own data dir (kept across restarts).

    It listens for clients on ``host`` (loopback by default) and for its peer on
    loopback. etcd cannot bind port 0 and report the port it got, so ports left at 0 are
    picked here; when etcd then fails to bind one (another process took it meanwhile),
    the first :meth:`start` tries again with other ports. Restarts keep the ports.

    With ``identity`` (a ``pki.Identity``: cert, key, CA) clients speak TLS and must
    present a certificate of that CA (``--client-cert-auth``); :meth:`enable_auth` then
    turns etcd's user/password auth on. The process is tied to this one
    (:mod:`kvmesh.services.children`): it gets SIGTERM when this process dies."""

    def __init__(
        self,
        data_dir: str,
        client_port: int = 0,
        peer_port: int = 0,
        log_path: str | None = None,
        host: str = "127.0.0.1",
        identity=None,
    ) -> None:
        self.data_dir = data_dir
        self.host = host
        self.identity = identity
        self._procs: list[subprocess.Popen] = []  # every etcd process started, until reaped
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
        scheme = "https" if self.identity else "http"
        client = f"{scheme}://{self.host}:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        tls = (
            [
                "--cert-file",
                self.identity.cert,
                "--key-file",
                self.identity.key,
                "--trusted-ca-file",
                self.identity.ca,
                "--client-cert-auth",
            ]
            if self.identity
            else []
        )
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            log_start = out.tell()
            self.proc = spawn_tied(
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
                    *tls,
                ],
                self._procs,
                stdout=out,
                stderr=subprocess.STDOUT,
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

    def _healthy(self, client: str) -> bool:
        ctx = None
        if self.identity:
            import ssl

            ctx = ssl.create_default_context(cafile=self.identity.ca)
            ctx.load_cert_chain(self.identity.cert, self.identity.key)
        try:
            with urllib.request.urlopen(f"{client}/health", timeout=1, context=ctx) as r:
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

    def enable_auth(self, user: str, password: str, timeout: float = 15) -> None:
        """Adds ``user`` (etcd's ``root`` role) and turns auth on: from then on every
        request needs that user's password (on top of the client certificate)."""
        from kvmesh.protos.etcd import rpc_pb2 as epb
        from kvmesh.protos.etcd import rpc_pb2_grpc as epbg

        if not self.identity:
            raise RuntimeError("etcd auth needs TLS: give Etcd an identity")
        ident = self.identity
        creds = etcd_credentials(ident.ca, ident.cert, ident.key)
        with grpc.secure_channel(self.endpoint, creds) as ch:
            auth = epbg.AuthStub(ch)
            auth.UserAdd(
                epb.AuthUserAddRequest(name=user, password=password),
                timeout=timeout,
                wait_for_ready=True,
            )
            auth.UserGrantRole(epb.AuthUserGrantRoleRequest(user=user, role="root"), timeout=5)
            auth.AuthEnable(epb.AuthEnableRequest(), timeout=5)

    def stop(self, grace: float = 10) -> None:
        """SIGTERM, then SIGKILL after ``grace`` s; every etcd process started is reaped."""
        try:
            terminate_all(self._procs, grace)
        finally:
            self._procs[:] = [p for p in self._procs if p.returncode is None]
            self.proc = None

    def kill(self) -> None:
        """SIGKILL to etcd, without waiting (a second signal during a teardown)."""
        kill_all(self._procs)

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
    (:attr:`secret`, given to them as ``KVMESH_SECRET``): see :func:`cluster_secret`.

    Every process is tied to this one (:mod:`kvmesh.services.children`): if this process
    dies, even by SIGKILL, they get SIGTERM. With ``max_restarts`` > 0, a service that
    exits unasked once the cluster has started is started again (same role, same
    arguments) after a backoff (``restart_backoff_s``, doubling per restart of that
    service within ``restart_window_s``), and etcd likewise; when a service has been
    restarted ``max_restarts`` times within the window, supervision gives up and
    :meth:`failure` says why. :meth:`stop` stops every process, SIGKILLs one that
    ignores SIGTERM for ``grace`` seconds, and removes etcd's data dir (logs stay).

    With ``tls`` the embedded etcd serves TLS only to clients with a certificate of the
    cluster's CA, and has auth on: user ``root`` with a random password
    (``<workdir>/etcd-password``, given to the services as ``KVMESH_ETCD_PASSWORD``)."""

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
        store_masters: int = 1,
        conductors: int = 1,
        log_level: str = "INFO",
        http_port: int = 0,
        tls: bool = False,
        api_key: str = "",
        max_restarts: int = 0,
        restart_window_s: float = 60.0,
        restart_backoff_s: float = 0.5,
        log: Callable[[str], None] | None = None,
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
        # store-master-0 leads; the others stand by (services.common.election)
        self.n_store_masters = max(1, store_masters)
        # conductor-0 gets conductor_port/http_port; the others serve at once (active-
        # active), each on ports of its own (see `conductors`)
        self.n_conductors = max(1, conductors)
        self.conductor_ports: list[int] = []
        self.http_ports: list[int] = []
        self.log_level = log_level
        # the conductor's OpenAI-compatible API (0 = any free port, read by start(); -1 = off)
        self.http_port = http_port
        self.secret = cluster_secret(self.workdir)  # the nodes' data-plane secret
        # tls: a throwaway CA + one certificate per service in <workdir>/tls (mutual TLS on
        # every gRPC channel); api_key: what status()/wait_ready() send to the conductor
        self.tls_dir = os.path.join(self.workdir, "tls") if tls else ""
        self.api_key = api_key
        self._pki: dict = {}
        # the embedded etcd: TLS + a root user when the cluster has TLS
        self.etcd_user = self.etcd_password = ""
        if tls and not etcd_endpoint:
            self.tls_args("etcd")
            self.etcd_user, self.etcd_password = "root", secrets.token_hex(16)
            path = os.path.join(self.workdir, "etcd-password")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.etcd_password + "\n")
        self.etcd = (
            None
            if etcd_endpoint
            else Etcd(
                os.path.join(self.workdir, "etcd"),
                log_path=os.path.join(self.workdir, "etcd.log"),
                identity=self._pki.get("etcd"),
            )
        )
        self._etcd_endpoint = etcd_endpoint or ""
        self.procs: dict[str, subprocess.Popen] = {}
        self._children: list[subprocess.Popen] = []  # every service process started
        self._stopped: set[str] = set()
        self._spawn_args: dict[str, tuple[str, list[str]]] = {}
        # supervision (see the class docstring)
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.restart_backoff_s = restart_backoff_s
        self._log = log or _log.warning
        self._lock = threading.RLock()
        self._restarts: dict[str, list[float]] = {}  # name -> times of its recent restarts
        self._restart_due: dict[str, float] = {}
        self._gave_up = ""
        self._supervising = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def etcd_endpoint(self) -> str:
        return self._etcd_endpoint or (self.etcd.endpoint if self.etcd else "")

    @property
    def conductor(self) -> str:
        if not self.conductor_port:
            raise RuntimeError("the conductor's port is known once the cluster has started")
        return f"127.0.0.1:{self.conductor_port}"

    @property
    def conductors(self) -> list[str]:
        """Every conductor's gRPC address, conductor-0's first."""
        if not self.conductor_ports:
            raise RuntimeError("the conductors' ports are known once the cluster has started")
        return [f"127.0.0.1:{p}" for p in self.conductor_ports]

    def env(self) -> dict[str, str]:
        """The environment of the cluster's processes (one started by hand too)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVMESH_SECRET": self.secret}
        if self.etcd_password:
            env.update(KVMESH_ETCD_USER=self.etcd_user, KVMESH_ETCD_PASSWORD=self.etcd_password)
        return env

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
            *self.etcd_tls_args(name),
        ]

    def etcd_tls_args(self, name: str) -> list[str]:
        """``--etcd-ca/--etcd-cert/--etcd-key`` of ``name`` for the embedded TLS etcd; []
        without (the user and password go in :meth:`env`)."""
        if not (self.etcd and self.etcd.identity):
            return []
        a = self.tls_args(name)
        return ["--etcd-ca", a[5], "--etcd-cert", a[1], "--etcd-key", a[3]]

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
        with self._lock:
            role, extra = self._spawn_args[name]
            return self.spawn(name, role, extra)

    def spawn(self, name: str, role: str, extra: list[str]) -> subprocess.Popen:
        argv = [sys.executable, "-m", "kvmesh.services.cli", role, *self.common_args(name)]
        with self._lock, open(os.path.join(self.workdir, f"{name}.log"), "ab") as log:
            p = spawn_tied(
                [*argv, *extra],
                self._children,
                stdout=log,
                stderr=subprocess.STDOUT,
                # a service whose launcher has died exits at once (Service.request_stop)
                env={**self.env(), "KVMESH_LAUNCHER_PID": str(os.getpid())},
            )
            self.procs[name] = p
            self._spawn_args[name] = (role, list(extra))
            self._stopped.discard(name)
            self._restart_due.pop(name, None)
            return p

    def start(self, timeout: float = 90) -> LocalCluster:
        deadline = time.monotonic() + timeout
        if self.etcd:
            # a local cluster's etcd is new each time: no data of an earlier run (whose
            # root password, conductor address, nodes are gone)
            shutil.rmtree(self.etcd.data_dir, ignore_errors=True)
            self.etcd.start()
            if self.etcd_password:
                self.etcd.enable_auth(self.etcd_user, self.etcd_password)
        for i in range(self.n_store_masters):
            self.spawn(f"store-master-{i}", "store-master", self.store_args)
        # a registration left by an earlier conductor-0 (kept etcd data, an etcd of our
        # caller) must not be read as this one's address
        for i in range(self.n_conductors):
            self._etcd_call(lambda etcd, i=i: etcd.delete(self._conductor_key(i)))
            self.spawn(
                f"conductor-{i}",
                "conductor",
                [
                    "--port",
                    str(self.conductor_port if i == 0 else 0),
                    "--http-port",
                    str(self.http_port if i == 0 or self.http_port < 0 else 0),
                    *self.conductor_args,
                ],
            )
        for i in range(self.n_prefill):
            self.spawn(f"prefill-{i}", "prefill", self.node_args)
        for i in range(self.n_decode):
            self.spawn(f"decode-{i}", "decode", self.node_args + self.decode_args)
        self.conductor_ports, self.http_ports = [], []
        for i in range(self.n_conductors):
            self._read_conductor_ports(deadline - time.monotonic(), i)
        self.wait_ready(max(1.0, deadline - time.monotonic()))
        if self.max_restarts > 0 and self._supervisor is None:
            self._supervising.set()
            self._supervisor = threading.Thread(
                target=self._supervise, name="kvmesh-supervisor", daemon=True
            )
            self._supervisor.start()
        return self

    # -- supervision -------------------------------------------------------------------
    def failure(self) -> str:
        """Why the cluster cannot go on ("" while it can): supervision gave up, or,
        without supervision, a service exited unasked."""
        if self._gave_up:
            return self._gave_up
        if not self._supervising.is_set():
            for name, p in list(self.procs.items()):
                if p.poll() is not None and name not in self._stopped:
                    return f"{name} exited with {p.returncode}"
        return ""

    def _supervise(self) -> None:
        try:
            while self._supervising.is_set() and not self._gave_up:
                self._supervise_once()
                time.sleep(0.1)
        except Exception as e:  # noqa: BLE001 - said by failure(), then up stops
            self._gave_up = f"supervision failed: {e!r}"
            self._log(self._gave_up)

    def _supervise_once(self) -> None:
        now = time.monotonic()
        dead: list[tuple[str, int | None]] = []
        with self._lock:
            for name, p in list(self.procs.items()):
                if name not in self._stopped and p.poll() is not None:
                    dead.append((name, p.returncode))
        if self.etcd and self.etcd.proc is not None and self.etcd.proc.poll() is not None:
            dead.append(("etcd", self.etcd.proc.returncode))
        for name, code in dead:
            if not self._supervising.is_set():
                return
            due = self._restart_due.get(name)
            if due is None:
                recent = [
                    t for t in self._restarts.get(name, []) if now - t < self.restart_window_s
                ]
                self._restarts[name] = recent
                if len(recent) >= self.max_restarts:
                    self._gave_up = (
                        f"{name} exited with {code} after {len(recent)} restart(s) in "
                        f"{self.restart_window_s:g}s; giving up (log: "
                        f"{os.path.join(self.workdir, name + '.log')})"
                    )
                    self._log(self._gave_up)
                    return
                delay = self.restart_backoff_s * 2 ** len(recent)
                self._restart_due[name] = now + delay
                self._log(
                    f"{name} exited with {code}; restarting it in {delay:.1f}s "
                    f"(restart {len(recent) + 1} of at most {self.max_restarts} in "
                    f"{self.restart_window_s:g}s)"
                )
            elif now >= due:
                self._restarts[name].append(now)
                if name == "etcd" and self.etcd is not None:
                    self._restart_due.pop(name, None)
                    self.etcd.start()  # same ports, same data
                    pid = self.etcd.proc.pid if self.etcd.proc else "?"
                    self._log(f"restarted etcd (pid {pid})")
                    continue
                with self._lock:
                    if name in self._stopped or not self._supervising.is_set():
                        continue
                    p = self.respawn(name)
                self._log(f"restarted {name} (pid {p.pid})")

    def _conductor_key(self, i: int = 0) -> str:
        return node_key(self.cluster, "conductor", f"conductor-{i}")

    def _etcd_call(self, fn: Callable[[EtcdClient], Awaitable[T]]) -> T:
        ident = self.etcd.identity if self.etcd else None
        creds = etcd_credentials(ident.ca, ident.cert, ident.key) if ident else None

        async def run() -> T:
            async with EtcdClient(
                self.etcd_endpoint,
                user=self.etcd_user or None,
                password=self.etcd_password or None,
                credentials=creds,
            ) as etcd:
                return await fn(etcd)

        return asyncio.run(run())

    def _check_alive(self) -> None:
        if self._gave_up:
            raise RuntimeError(self._gave_up)
        if self._supervising.is_set():  # a dead service is being restarted
            return
        for name, p in list(self.procs.items()):
            if p.poll() is not None and name not in self._stopped:
                path = os.path.join(self.workdir, name + ".log")
                raise RuntimeError(
                    f"{name} exited with {p.returncode}{_last_error(path)}; see {path}"
                )

    def _read_conductor_ports(self, timeout: float, i: int = 0) -> None:
        """Reads the ports conductor-``i`` bound from its etcd registration, and pins them
        for its restarts (clients keep its address)."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            try:
                raw = self._etcd_call(lambda etcd: etcd.get(self._conductor_key(i)))
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
        port = int(info["grpc"].rsplit(":", 1)[1])
        http = int(info["http"].rsplit(":", 1)[1]) if info.get("http") else -1
        self.conductor_ports.append(port)
        self.http_ports.append(http)
        if i == 0:
            self.conductor_port = port
            if self.http_port == 0 and http > 0:
                self.http_port = http
        name = f"conductor-{i}"
        role, extra = self._spawn_args[name]
        pinned = {"--port": port, "--http-port": http if http > 0 else self.http_port}
        extra = [
            str(pinned[extra[i - 1]]) if i and extra[i - 1] in pinned else a
            for i, a in enumerate(extra)
        ]
        self._spawn_args[name] = (role, extra)

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
        """Stops ``name`` with ``sig`` (SIGKILL after ``wait`` s); it is not restarted."""
        with self._lock:
            p = self.procs[name]
            self._stopped.add(name)
            self._restart_due.pop(name, None)
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
        return self.respawn(name)

    def stop(self, grace: float = 20) -> None:
        """Stops every process: SIGTERM (the nodes, then the conductor and the
        store-master, then etcd), SIGKILL to any still running ``grace`` s later; each is
        reaped. Then etcd's data dir is removed (the whole workdir when it was a temporary
        one). Interrupted (a second Ctrl-C), it still kills, reaps and removes all that."""
        self._supervising.clear()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(30)  # it may be in the middle of a restart
        self._supervisor = None  # a later start() supervises again
        try:
            with self._lock:
                self._stopped.update(self.procs)
                rank = {"prefill": 0, "decode": 0, "conductor": 1, "store-master": 2}
                order = sorted(self._all_procs(), key=lambda p: rank.get(self._role_of(p), 0))
            terminate_all(order, grace)
            if self.etcd:
                self.etcd.stop(grace)
        finally:
            self.kill()  # only an interrupted teardown leaves any to kill
            for p in self._all_procs():
                if p.returncode is None:
                    try:
                        p.wait(10)
                    except subprocess.TimeoutExpired:
                        pass
            if self.etcd:
                self.etcd.stop(0)
                shutil.rmtree(self.etcd.data_dir, ignore_errors=True)
            if self._own_dir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def _all_procs(self) -> list[subprocess.Popen]:
        """Every service process started, and any a caller put in :attr:`procs`."""
        extra = [p for p in self.procs.values() if p not in self._children]
        return [*self._children, *extra]

    def _role_of(self, p: subprocess.Popen) -> str:
        for name, (role, _) in self._spawn_args.items():
            if self.procs.get(name) is p:
                return role
        return ""

    def kill(self) -> None:
        """SIGKILL to every process of the cluster, without waiting: what a second
        signal during :meth:`stop` does (``stop`` still reaps them and cleans up)."""
        kill_all(self._all_procs())
        if self.etcd:
            self.etcd.kill()

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
    p.add_argument(
        "--store-masters",
        type=int,
        default=1,
        help="store-masters: one leads, the others stand by and take over when its "
        "etcd lease lapses",
    )
    p.add_argument(
        "--conductors",
        type=int,
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
        "--max-restarts",
        type=int,
        default=5,
        help="a service (or etcd) that dies is restarted, after a backoff doubling from "
        "0.5 s, at most this many times within --restart-window; then the cluster stops "
        "(0 = stop the cluster when any process dies)",
    )
    p.add_argument(
        "--restart-window",
        type=float,
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
    model = getattr(args, "model", None) or ("tiny" if args.demo is None else "demo")
    try:  # a bad --model fails before etcd starts; a hub id is downloaded once, here
        from kvmesh.services.engine.checkpoint import CheckpointError, resolve_model

        resolve_model(model)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.port:  # before etcd starts: a second cluster must not share the port
        try:
            check_port(f"127.0.0.1:{args.port}")
        except PortInUse as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    cluster = LocalCluster(
        args.workdir,
        prefill=args.prefill,
        decode=args.decode,
        store_masters=getattr(args, "store_masters", 1),
        conductors=getattr(args, "conductors", 1),
        conductor_port=args.port,
        http_port=_http_port(args.http_port),
        node_args=["--model", model, "--block-size", str(args.block_size)],
        tls=getattr(args, "tls", False),
        conductor_args=(["--api-keys", args.api_keys] if getattr(args, "api_keys", "") else None),
        api_key=(getattr(args, "api_keys", "") or "").split(",")[0].split(":")[0],
        max_restarts=getattr(args, "max_restarts", 5),
        restart_window_s=getattr(args, "restart_window", 60.0),
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    client = " ".join(cluster.tls_args("client")) if cluster.tls_dir else ""
    client += f" --api-key {cluster.api_key}" if cluster.api_key else ""
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
        print(
            f"starting etcd, store-master, conductor, {args.prefill} prefill and "
            f"{args.decode} decode node(s); logs in {cluster.workdir}",
            flush=True,
        )
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
            if failure:
                print(f"{failure}; stopping the cluster", file=sys.stderr, flush=True)
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
