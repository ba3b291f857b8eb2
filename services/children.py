"""Child processes tied to the process that started them, for :mod:`kvmesh.services.launcher`.

A local cluster's services and its etcd run in their own sessions (a Ctrl-C in the
terminal reaches only the launcher, which then stops them in order). Nothing else would
tie them to the launcher: killed with SIGKILL (the OOM killer, ``timeout -s KILL``), it
would leave them serving with parent pid 1. So on Linux every child is started with a
parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``), then ``getppid()`` checked
again (a launcher that died before the call took effect is not missed), then the real
command exec'd in the same process.

That is done by an exec wrapper, not by ``preexec_fn``: Python code between fork and exec
in a process with threads (the launcher has several) can deadlock the child on a lock some
other thread held at the fork. The wrapper is util-linux ``setpriv --pdeathsig TERM``
followed by ``/bin/sh`` checking ``$PPID`` and exec'ing the command; without ``setpriv``, a
small ``python -c`` shim that calls ``prctl``, checks ``getppid()`` and ``os.execvp``'s.
The signal survives both execs (it is cleared only by a set-user-ID exec); the pid the
caller gets back is the real command's.

Linux sends that signal when the *thread* that forked the child ends, not the process.
A child forked from a short-lived thread (``asyncio.to_thread``, a worker pool) would be
told to stop when that thread ends; so every child is forked by one long-lived thread of
this module, whatever thread asks. That thread also records each child in the caller's
list before the caller gets it back, so a caller interrupted while waiting (a signal
raising ``KeyboardInterrupt``) still finds the child there when it tears down.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_LINUX = sys.platform.startswith("linux")


@functools.cache
def _setpriv_with_pdeathsig() -> str | None:
    """setpriv, if it is installed and knows --pdeathsig (util-linux 2.33 and later)."""
    path = shutil.which("setpriv") if _LINUX else None
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return path if "--pdeathsig" in out.stdout + out.stderr else None


# after setpriv: $1 is the expected parent pid, the rest the command
_SH_CHECK = 'p=$1; shift; [ "$PPID" = "$p" ] || exit 1; exec "$@"'
# argv: sig, expected parent pid, command... (1 is PR_SET_PDEATHSIG)
_PY_SHIM = (
    "import ctypes, os, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]), 0, 0, 0) != 0:\n"
    "    sys.exit('kvmesh: prctl(PR_SET_PDEATHSIG) failed: ' + os.strerror(ctypes.get_errno()))\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def tied_argv(argv: list[str], parent: int, sig: int, via: str | None = None) -> list[str]:
    """``argv`` wrapped so that it runs with parent-death signal ``sig`` and only while
    its parent is ``parent``. ``via``: ``"setpriv"``, ``"python"``, or None for setpriv
    when it is installed (always unwrapped off Linux)."""
    if not _LINUX:
        return list(argv)
    setpriv = _setpriv_with_pdeathsig()
    via = via or ("setpriv" if setpriv else "python")
    if via == "setpriv":
        if setpriv is None:
            raise FileNotFoundError(
                errno.ENOENT, "setpriv (util-linux 2.33 or later, for --pdeathsig) is not installed"
            )
        name = signal.Signals(sig).name.removeprefix("SIG")
        sh = ["/bin/sh", "-c", _SH_CHECK, "kvmesh-tied", str(parent), *argv]
        return [setpriv, "--pdeathsig", name, "--", *sh]
    if via == "python":
        return [sys.executable, "-I", "-S", "-c", _PY_SHIM, str(int(sig)), str(parent), *argv]
    raise ValueError(f"via must be 'setpriv' or 'python', not {via!r}")


def _check_runnable(argv: list[str], env: dict | None) -> None:
    """The FileNotFoundError Popen would raise for a missing program: the wrapper would
    otherwise start fine and its exec fail later, out of sight."""
    prog = argv[0]
    path = env.get("PATH", os.defpath) if env is not None else None
    if os.sep in prog:
        if not os.access(prog, os.X_OK):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), prog)
    elif shutil.which(prog, path=path) is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), prog)


class _Spawner:
    """The one thread that forks every tied child (see the module's docstring)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def popen(
        self, argv: list[str], track: list[subprocess.Popen], via: str | None, **kw
    ) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="kvmesh-child-spawner", daemon=True
                )
                self._thread.start()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((argv, via, kw, track, fut))
        return fut.result()

    def _run(self) -> None:
        while True:
            argv, via, kw, track, fut = self._q.get()
            try:
                _check_runnable(argv, kw.get("env"))
                wrapped = tied_argv(argv, os.getpid(), signal.SIGTERM, via)
                p = subprocess.Popen(wrapped, **kw)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
                continue
            track.append(p)  # before the caller can be interrupted
            fut.set_result(p)


_SPAWNER = _Spawner()


def spawn_tied(
    argv: list[str], track: list[subprocess.Popen], via: str | None = None, **popen_kw
) -> subprocess.Popen:
    """``subprocess.Popen(argv, **popen_kw)`` in a new session, tied to this process: it
    gets SIGTERM when this process dies (Linux), and is appended to ``track``. ``via``
    picks the exec wrapper (:func:`tied_argv`)."""
    return _SPAWNER.popen(argv, track, via, start_new_session=True, **popen_kw)


def terminate_all(procs: Iterable[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every process still running, up to ``grace`` seconds for all of them to
    exit, then SIGKILL to those left; every one is reaped. Interrupted (a second signal),
    it still kills and reaps them all before the interruption goes on."""
    procs = list(procs)
    try:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        kill_all(procs)
        for p in procs:
            try:
                p.wait(10)  # SIGKILLed: only a process stuck in the kernel takes longer
            except subprocess.TimeoutExpired:
                pass


def kill_all(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILL to every process still running; does not wait (safe in a signal handler)."""
    for p in list(procs):
        if p.returncode is None:
            try:
                p.kill()
            except OSError:
                pass
