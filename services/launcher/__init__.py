"""Local clusters: ``kvmesh up`` and the integration tests start etcd and the four services
as real processes on this machine with :class:`LocalCluster`.

- :mod:`.local_etcd`: the embedded single-member etcd (:class:`Etcd`), and
  :func:`listening_ports` (which TCP ports a process listens on);
- :mod:`.cluster`: :class:`LocalCluster` (start, supervise, restart, stop) and
  :func:`cluster_secret`;
- :mod:`.workdir_lock`: one cluster per workdir (:class:`WorkdirLock`);
- :mod:`.up`: ``kvmesh up`` itself (:func:`add_up_arguments`, :func:`up`)."""

from __future__ import annotations

from kvmesh.services.launcher.cluster import CONDUCTOR, LocalCluster, cluster_secret
from kvmesh.services.launcher.local_etcd import ETCD_BIND_ATTEMPTS, Etcd, listening_ports
from kvmesh.services.launcher.up import add_up_arguments, up
from kvmesh.services.launcher.workdir_lock import WorkdirInUse, WorkdirLock

__all__ = [
    "CONDUCTOR",
    "ETCD_BIND_ATTEMPTS",
    "Etcd",
    "LocalCluster",
    "WorkdirInUse",
    "WorkdirLock",
    "add_up_arguments",
    "cluster_secret",
    "listening_ports",
    "up",
]
