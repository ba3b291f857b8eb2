"""The embedded etcd of a local cluster (:class:`Etcd`): one member, its own data dir, ports
picked here (etcd cannot bind port 0), TLS and auth when the cluster has them."""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc

from kvmesh.services.children import kill_all, spawn_tied, terminate_all
from kvmesh.services.common.etcd import etcd_credentials

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
                # None: /proc cannot tell, trusted only while etcd still runs (it reads
                # None too once etcd has exited, failing to bind the port /health hit)
                if self.proc.poll() is None and (ports is None or self.client_port in ports):
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
