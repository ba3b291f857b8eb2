"""CPU budgets: a process held to a fraction of a core by the kernel's CFS bandwidth control.

Equal hardware on one machine means equal CPU budgets: four model nodes of 0.375 cores
each share two cores and leave the rest to the control plane. A :class:`CpuBudget` is one
cgroup with a quota of ``cores x period`` per ``period`` (``PERIOD_US``, 10 ms, so a
throttled process stalls for milliseconds, not for a 100 ms default period), and the
process(es) placed in it. Both cgroup versions:

- **v2** (``cpu.max``, ``cpu.stat``'s ``usage_usec``/``throttled_usec``): the group is made
  beside this process's own cgroup's children, under the unified mount; the ``cpu``
  controller must be enabled in the parent's ``cgroup.subtree_control`` (tried, else
  :class:`CpuBudgetError` says so).
- **v1** (``cpu.cfs_quota_us``/``cpu.cfs_period_us`` in the ``cpu`` hierarchy; usage from
  ``cpuacct.usage`` where a ``cpuacct`` hierarchy exists, co-mounted or not): the group is
  made in every hierarchy the counters need.

Each group is named ``kvmesh/<name>.<pid of its maker>``; :meth:`CpuBudget.close` (or the
next budget made on the machine, once its maker is dead) removes it. Writing cgroup files
needs root or a delegated subtree: :func:`support` says, without side effects beyond a
probe group, whether budgets can be made here and why not.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass, field

PERIOD_US = 10_000  # CFS period: a throttled group waits at most this long
MIN_QUOTA_US = 1_000  # the kernel's smallest quota
# A budget is a cap and, as far as the scheduler's weights go, a promise: a budgeted group
# weighs this many times a default process when the machine is contended, so work outside
# every budget (a test run, a build) slows it little. It never gets more than its quota.
WEIGHT = 4
GROUP_DIR = "kvmesh"


class CpuBudgetError(RuntimeError):
    """A budget cannot be made or joined here; the message says why and what to do."""


def threads_for(cores: float) -> int:
    """Torch threads for a budget of ``cores``: ceil(cores), at least 1."""
    return max(1, math.ceil(cores - 1e-9))


def quota_us(cores: float, period_us: int = PERIOD_US) -> int:
    if not 0 < cores <= 1024:
        raise CpuBudgetError(f"cpus: {cores} must be > 0 (a fraction of a core, e.g. 0.375)")
    return max(MIN_QUOTA_US, round(cores * period_us))


@dataclass
class _Mounts:
    v2: str = ""  # the unified mount, when the cpu controller lives there
    cpu: str = ""  # v1 cpu hierarchy
    cpuacct: str = ""  # v1 cpuacct hierarchy (may equal cpu)


def _mounts(mounts_file: str = "/proc/self/mounts") -> _Mounts:
    m = _Mounts()
    try:
        with open(mounts_file) as f:
            lines = f.read().splitlines()
    except OSError:
        return m
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        path, fstype, opts = parts[1], parts[2], parts[3].split(",")
        if fstype == "cgroup":
            if "cpu" in opts and not m.cpu:
                m.cpu = path
            if "cpuacct" in opts and not m.cpuacct:
                m.cpuacct = path
        elif fstype == "cgroup2" and not m.v2:
            try:
                with open(os.path.join(path, "cgroup.controllers")) as f:
                    if "cpu" in f.read().split():
                        m.v2 = path
            except OSError:
                pass
    return m


def _own_group(controller: str, pid: int | str = "self") -> str:
    """This process's cgroup path in the hierarchy of ``controller`` ("" = the v2 one)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                if (controller and controller in ctrls.split(",")) or (
                    not controller and ctrls == ""
                ):
                    return path.lstrip("/")
    except OSError:
        pass
    return ""


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep(parent: str) -> None:
    """Removes groups under ``parent`` whose maker is dead (rmdir fails on a busy one)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for n in names:
        m = re.fullmatch(r".+\.(\d+)", n)
        if m and not _pid_alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(parent, n))


@dataclass
class CpuBudget:
    """One cgroup holding its processes to ``cores`` of CPU (see the module docstring)."""

    cores: float  # the budget, in cores
    version: int  # 1 or 2
    dirs: list[str] = field(default_factory=list)  # the group, one dir per hierarchy
    usage_file: str = ""  # cpuacct.usage (v1, ns) or cpu.stat (v2, usage_usec); "" = none
    stat_file: str = ""  # cpu.stat: throttling counters

    @classmethod
    def create(cls, name: str, cores: float) -> CpuBudget:
        """A new group ``kvmesh/<name>.<pid>`` with quota ``cores`` x ``PERIOD_US``.
        Raises :class:`CpuBudgetError` with the reason where that cannot be done."""
        quota = quota_us(cores)
        if not re.fullmatch(r"[\w.-]+", name):
            raise CpuBudgetError(f"cpu budget name {name!r}: letters, digits, '.', '_', '-'")
        m = _mounts()
        leaf = f"{name}.{os.getpid()}"
        try:
            if m.cpu:
                return cls._create_v1(m, leaf, cores, quota)
            if m.v2:
                return cls._create_v2(m.v2, leaf, cores, quota)
        except OSError as e:
            raise CpuBudgetError(
                f"cannot make a cgroup for a CPU budget of {cores:g} cores ({e.strerror}: "
                f"{e.filename}); run as root or in a delegated cgroup, or leave --cpus unset"
            ) from None
        raise CpuBudgetError(
            "no cgroup cpu controller is mounted (neither v1 'cpu' nor a cgroup2 with "
            "'cpu' in cgroup.controllers); leave --cpus unset"
        )

    @classmethod
    def _create_v1(cls, m: _Mounts, leaf: str, cores: float, quota: int) -> CpuBudget:
        dirs = []
        b = cls(cores, 1)
        for mount, ctrl in ((m.cpu, "cpu"), (m.cpuacct, "cpuacct")):
            if not mount or (ctrl == "cpuacct" and mount == m.cpu):
                continue
            parent = os.path.join(mount, _own_group(ctrl), GROUP_DIR)
            os.makedirs(parent, exist_ok=True)
            if ctrl == "cpu":  # the budgets' parent weighs as much as its busy children
                _write(os.path.join(parent, "cpu.shares"), str(1024 * WEIGHT * 8))
            _sweep(parent)
            d = os.path.join(parent, leaf)
            os.makedirs(d, exist_ok=True)
            dirs.append(d)
        b.dirs = dirs
        cpu = dirs[0]
        _write(os.path.join(cpu, "cpu.cfs_period_us"), str(PERIOD_US))
        _write(os.path.join(cpu, "cpu.cfs_quota_us"), str(quota))
        _write(os.path.join(cpu, "cpu.shares"), str(1024 * WEIGHT))
        b.stat_file = os.path.join(cpu, "cpu.stat")
        acct = next((d for d in dirs if os.path.exists(os.path.join(d, "cpuacct.usage"))), "")
        b.usage_file = os.path.join(acct, "cpuacct.usage") if acct else ""
        return b

    @classmethod
    def _create_v2(cls, mount: str, leaf: str, cores: float, quota: int) -> CpuBudget:
        parent = os.path.join(mount, _own_group(""), GROUP_DIR)
        os.makedirs(parent, exist_ok=True)
        for p in (os.path.dirname(parent), parent):
            ctl = os.path.join(p, "cgroup.subtree_control")
            with open(ctl) as f:
                if "cpu" not in f.read().split():
                    try:
                        _write(ctl, "+cpu")
                    except OSError as e:
                        raise CpuBudgetError(
                            f"cgroup v2: cannot enable the cpu controller in {ctl} "
                            f"({e.strerror}); a cgroup with processes of its own cannot "
                            "delegate it: run kvmesh from a cgroup that can"
                        ) from None
        _write(os.path.join(parent, "cpu.weight"), str(100 * WEIGHT * 8))
        _sweep(parent)
        d = os.path.join(parent, leaf)
        os.makedirs(d, exist_ok=True)
        _write(os.path.join(d, "cpu.max"), f"{quota} {PERIOD_US}")
        _write(os.path.join(d, "cpu.weight"), str(100 * WEIGHT))
        stat = os.path.join(d, "cpu.stat")
        return cls(cores, 2, [d], stat, stat)

    def add(self, pid: int = 0) -> None:
        """Moves process ``pid`` (0 = this one), every thread of it, into the group."""
        for d in self.dirs:
            try:
                _write(os.path.join(d, "cgroup.procs"), str(pid or os.getpid()))
            except OSError as e:
                raise CpuBudgetError(
                    f"cannot place pid {pid or os.getpid()} in {d} ({e.strerror})"
                ) from None

    def usage_seconds(self) -> float | None:
        """CPU time the group's processes used since it was made (the cgroup's own
        counter); None where the hierarchy has none."""
        try:
            with open(self.usage_file) as f:
                text = f.read()
        except OSError:
            return None
        if self.version == 1:
            return int(text.strip()) / 1e9
        m = re.search(r"^usage_usec (\d+)", text, re.M)
        return int(m.group(1)) / 1e6 if m else None

    def throttling(self) -> tuple[int, int, float]:
        """(periods, periods throttled, seconds throttled) from ``cpu.stat``."""
        try:
            with open(self.stat_file) as f:
                kv = dict(line.split() for line in f if len(line.split()) == 2)
        except OSError:
            return 0, 0, 0.0
        if self.version == 1:
            t = int(kv.get("throttled_time", 0)) / 1e9
        else:
            t = int(kv.get("throttled_usec", 0)) / 1e6
        return int(kv.get("nr_periods", 0)), int(kv.get("nr_throttled", 0)), t

    def leave(self) -> None:
        """Moves this process out of the group, back to the group the group was made in."""
        for d in self.dirs:
            parent = os.path.dirname(os.path.dirname(d))
            with contextlib.suppress(OSError):
                with open(os.path.join(d, "cgroup.procs")) as f:
                    mine = str(os.getpid()) in f.read().split()
                if mine:
                    _write(os.path.join(parent, "cgroup.procs"), str(os.getpid()))

    def close(self) -> None:
        """Leaves the group (:meth:`leave`) and removes it; a group other processes
        still hold stays (the next sweep removes it)."""
        self.leave()
        for d in self.dirs:
            with contextlib.suppress(OSError):
                os.rmdir(d)


def support() -> str:
    """ "" where CPU budgets can be made on this machine, else why not (one line)."""
    try:
        b = CpuBudget.create("probe", 1.0)
    except CpuBudgetError as e:
        return str(e)
    b.close()
    return ""
