"""Run a real single-node etcd on free loopback ports for tests.

    with etcd_server() as srv:
        client = EtcdClient(srv.endpoint)
        ...
        srv.restart(down_for=3.0)   # SIGTERM, wait, (sleep), start again on same ports/data dir
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

ETCD_BIN = os.environ.get("ETCD_BIN") or shutil.which("etcd") or "/usr/bin/etcd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """A single-node etcd process with a private data dir on two free loopback ports."""

    def __init__(self, data_dir: Path | None = None):
        self._tmp = None if data_dir else tempfile.mkdtemp(prefix="kvmesh-etcd-")
        self.data_dir = Path(data_dir or self._tmp)
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir / "etcd.log"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 15.0) -> None:
        client_url = f"http://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        args = [
            ETCD_BIN,
            "--name", "test",
            "--data-dir", str(self.data_dir / "etcd"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"test={peer_url}",
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--logger", "zap",
            "--log-level", "warn",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=0.5) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"etcd not healthy after {timeout}s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after 10 s)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, down_for: float = 0.0) -> None:
        """Stop, stay down ``down_for`` seconds, start again on the same ports and data dir."""
        self.stop()
        time.sleep(down_for)
        self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


@contextlib.contextmanager
def etcd_server() -> Iterator[EtcdServer]:
    """Start an etcd, yield it, and always stop it and delete its data."""
    srv = EtcdServer()
    try:
        srv.start()
        yield srv
    finally:
        srv.cleanup()
