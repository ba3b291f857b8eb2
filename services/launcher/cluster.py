"""A local cluster (:class:`LocalCluster`): etcd (:mod:`.local_etcd`) and the four services
as real processes on this machine, each tied to this one, supervised when asked."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc

from kvmesh.services.children import kill_all, spawn_tied, terminate_all
from kvmesh.services.client import cluster_status
from kvmesh.services.common.cpu_budget import CpuBudget, CpuBudgetError
from kvmesh.services.common.etcd import EtcdClient, EtcdError, etcd_credentials
from kvmesh.services.common.registry import node_key
from kvmesh.services.common.settings import KNOWN_SECRETS, THREAD_SHARE_ENV
from kvmesh.services.launcher.local_etcd import Etcd
from kvmesh.services.launcher.workdir_lock import WorkdirLock

T = TypeVar("T")

_log = logging.getLogger(__name__)


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


CONDUCTOR = "conductor-0"


def node_threads(nodes: int) -> int:
    """Torch threads for each of ``nodes`` model nodes on this machine: its usable cores
    shared out, at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, nodes))


def cluster_secret(workdir: str, warn: Callable[[str], None] | None = None) -> str:
    """The data-plane secret of a local cluster: the operator's ``KVMESH_SECRET`` when it is
    set (and not one of the well-known ones), else a random one for this cluster. It is
    written to ``<workdir>/secret`` (mode 0600), so a node started by hand can join:
    ``KVMESH_SECRET=$(cat <workdir>/secret) kvmesh prefill ...``. A well-known
    ``KVMESH_SECRET`` is replaced, and ``warn`` (default: a log warning) says so."""
    given = os.environ.get("KVMESH_SECRET", "")
    secret = given if given and given not in KNOWN_SECRETS else secrets.token_hex(32)
    path = os.path.join(workdir, "secret")
    if given and secret != given:
        (warn or _log.warning)(
            f"warning: KVMESH_SECRET is the well-known {given!r}, which anyone can read in "
            f"kvmesh's source, so this cluster does not use it: its nodes share a random "
            f"secret instead, written to {path}. A node started by hand joins with "
            f"KVMESH_SECRET=$(cat {path}); nodes started with {given!r} are refused"
        )
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
    The nodes share this machine's cores out (:func:`node_threads`) where nothing else
    sets their ``threads`` (``--threads`` in ``node_args``/``decode_args``,
    ``KVMESH_THREADS``, a config file).

    Every process is tied to this one (:mod:`kvmesh.services.children`): if this process
    dies, even by SIGKILL, they get SIGTERM. With ``max_restarts`` > 0, a service that
    exits unasked once the cluster has started is started again (same role, same
    arguments) after a backoff (``restart_backoff_s``, doubling per restart of that
    service within ``restart_window_s``), and etcd likewise; when a service has been
    restarted ``max_restarts`` times within the window, supervision gives up and
    :meth:`failure` says why. :meth:`stop` stops every process, SIGKILLs one that
    ignores SIGTERM for ``grace`` seconds, and removes etcd's data dir (logs stay).

    One cluster per workdir: the constructor takes the workdir's lock
    (:class:`~kvmesh.services.launcher.workdir_lock.WorkdirLock`) before it writes
    anything there, and raises ``WorkdirInUse`` naming the PID that holds it; :meth:`stop`
    lets it go once it is done with the workdir.

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
        cpus: float = 0.0,
        control_cpus: float = 0.0,
    ) -> None:
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="kvmesh-")
        Path(self.workdir).mkdir(parents=True, exist_ok=True)
        # one cluster per workdir: locked before anything in it is written (WorkdirInUse
        # names the holder), held until stop() is done with it
        self._workdir_lock = WorkdirLock(self.workdir)
        self._workdir_lock.acquire()
        self.cluster = cluster
        self.n_prefill, self.n_decode = prefill, decode
        self.conductor_port = conductor_port  # 0 until start() reads the bound port
        self.conductor_host = "127.0.0.1"  # start() reads the address it registered
        self.lease_ttl = lease_ttl
        self.node_args = list(node_args or [])
        self.decode_args = decode_args or []  # after node_args, for decode nodes only
        # the nodes share this machine's cores: each torch left to its default takes all
        # of them, and their spinning thread pools then slow every forward (and the
        # start-up profile) several times over. A hint below every way of setting
        # ``threads`` (flag, KVMESH_THREADS, the TOML file), read only where none did
        self.thread_share = node_threads(prefill + decode)
        seg = (
            self.node_args[self.node_args.index("--segment-memory") + 1]
            if "--segment-memory" in self.node_args
            else "1"
        )
        self.expect_store = seg.strip() not in ("0", "0B", "0MiB")
        # CPU budgets (services.common.cpu_budget): each model node its own cgroup of
        # ``cpus`` cores (``--cpus``); etcd, the store-master(s) and the conductor(s) one
        # cgroup of ``control_cpus`` together, made here; 0 = none
        self.cpus = cpus
        self.control_cpus = control_cpus
        self._control_budget: CpuBudget | None = None
        if cpus > 0:
            self.node_args = [*self.node_args, "--cpus", f"{cpus:g}"]
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
        # the nodes' data-plane secret (a well-known KVMESH_SECRET replaced, with a warning)
        self.secret = cluster_secret(self.workdir, log)
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
        return f"{self.conductor_host}:{self.conductor_port}"

    @property
    def conductors(self) -> list[str]:
        """Every conductor's gRPC address, conductor-0's first."""
        if not self.conductor_ports:
            raise RuntimeError("the conductors' ports are known once the cluster has started")
        return [f"{self.conductor_host}:{p}" for p in self.conductor_ports]

    def env(self) -> dict[str, str]:
        """The environment of the cluster's processes (one started by hand too)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVMESH_SECRET": self.secret}
        env[THREAD_SHARE_ENV] = str(self.thread_share)
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
        """``--tls-cert/--tls-key/--tls-ca`` of ``name`` ("client" for CLIs); [] without TLS.
        The certificate carries the role ``name`` starts with (``decode-1``: decode; see
        ``services/common/roles.py``); etcd's carries none."""
        if not self.tls_dir:
            return []
        from kvmesh.services.common.roles import CLIENT, role_of_name

        if not self._pki:
            from kvmesh.services.common.pki import DevCA

            self._ca = DevCA(self.tls_dir)
            self._pki["client"] = self._ca.issue("client", roles=[CLIENT])
        if name not in self._pki:
            role = role_of_name(name)
            self._pki[name] = self._ca.issue(name, roles=[role] if role else [])
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
            if role in ("conductor", "store-master"):
                self._budget_control(p.pid)
            self._spawn_args[name] = (role, list(extra))
            self._stopped.discard(name)
            self._restart_due.pop(name, None)
            return p

    def _budget_control(self, pid: int) -> None:
        """Puts ``pid`` (etcd, a store-master, a conductor) in the control plane's budget."""
        if self.control_cpus <= 0:
            return
        if self._control_budget is None:
            self._control_budget = CpuBudget.create(f"{self.cluster}-control", self.control_cpus)
        try:
            self._control_budget.add(pid)
        except CpuBudgetError as e:  # it exited already: its restart is placed again
            self._log(f"control-plane CPU budget: {e}")

    def control_cpu_seconds(self) -> float | None:
        """CPU time the control plane's budget group has used (None without one)."""
        b = self._control_budget
        return b.usage_seconds() if b is not None else None

    def start(self, timeout: float = 90) -> LocalCluster:
        deadline = time.monotonic() + timeout
        self._workdir_lock.acquire()  # again after a stop() (a no-op while held)
        if self.etcd:
            # a local cluster's etcd is new each time: no data of an earlier run (whose
            # root password, conductor address, nodes are gone)
            shutil.rmtree(self.etcd.data_dir, ignore_errors=True)
            self.etcd.start()
            if self.etcd.proc is not None:
                self._budget_control(self.etcd.proc.pid)
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

    @property
    def gave_up(self) -> str:
        """Why supervision gave up ("" while it has not): logged once when it did."""
        return self._gave_up

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
                    if self.etcd.proc is not None:
                        self._budget_control(self.etcd.proc.pid)
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
            self.conductor_host = info["grpc"].rsplit(":", 1)[0]
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
            if self._control_budget is not None:
                self._control_budget.close()
                self._control_budget = None
            self._workdir_lock.release()

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
