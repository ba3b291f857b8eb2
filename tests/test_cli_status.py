"""``kvmesh status --watch`` starts light and stops at once (issue 18, item 10).

The watch's first frame waits for Python's start and one ClusterStatus; the CLI imports
only what its command needs (the launcher, with its etcd client and process control,
only for ``kvmesh up``). Ctrl-C and SIGTERM end the refreshes wherever they are, a
call in flight included, with exit status 0."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.timeout(120)


def test_client_commands_do_not_import_the_launcher():
    code = (
        "import sys, kvmesh.services.cli; "
        "print(sorted(m for m in sys.modules if m in "
        "('kvmesh.services.launcher', 'kvmesh.services.common.etcd')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@contextlib.contextmanager
def _black_hole() -> Iterator[str]:
    """A port that accepts connections and never answers (a conductor that hangs)."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(64)
        yield f"127.0.0.1:{ls.getsockname()[1]}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_watch_stops_at_a_signal_with_a_call_in_flight(sig):
    with _black_hole() as conductor:
        w = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.services.cli", "status", "--watch"]
            + ["--conductor", conductor, "--interval", "0.05"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(w.stdout), daemon=True)
        reader.start()
        try:
            # the first frame (the call's deadline passed); the next call is in flight
            deadline = time.monotonic() + 90
            while not any("kvmesh status" in line for line in lines):
                assert w.poll() is None and time.monotonic() < deadline, "".join(lines)
                time.sleep(0.05)
            w.send_signal(sig)
            w.wait(timeout=60)
            err = w.stderr.read()
        finally:
            if w.poll() is None:
                w.kill()
                w.wait()
        reader.join(10)
    assert w.returncode == 0, err
    assert "Traceback" not in err, err
