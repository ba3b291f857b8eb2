"""One local cluster per workdir (:class:`WorkdirLock`): a ``LocalCluster`` (so ``kvmesh
up``) holds an exclusive ``flock`` on ``<workdir>/kvmesh.lock`` from before it writes
anything there until it has stopped, and a second one on the same workdir refuses to
start, naming the PID that holds it, instead of deleting the first one's etcd data and
overwriting its secret and logs.

The lock is the kernel's: it goes with the holding process, however that ends (SIGKILL
included), so a stale lock file never blocks a later start. The file itself stays (with
the holder's PID while held): removing it would let a second process lock a new file
while a third still holds the old one."""

from __future__ import annotations

import fcntl
import os

LOCK_NAME = "kvmesh.lock"


class WorkdirInUse(RuntimeError):
    """Another process holds the workdir's lock; the message names it."""


class WorkdirLock:
    """The exclusive lock of one workdir: :meth:`acquire` (idempotent), :meth:`release`."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.path = os.path.join(workdir, LOCK_NAME)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Takes the lock, or raises :class:`WorkdirInUse` at once (never waits). Only the
        lock file is opened before the lock is held, and nothing in it is changed."""
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise WorkdirInUse(
                f"workdir {self.workdir} is in use by another kvmesh cluster (pid {holder} "
                f"holds {self.path}): stop that one first, or give this one another "
                f"--workdir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Lets the lock go (the file stays, emptied)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:  # the workdir was a temporary one, removed already
            pass
        os.close(fd)

    def __del__(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
