"""Service registry on etcd: lease-backed node registration and membership watching.

Nodes register under ``/kvmesh/<cluster>/nodes/<role>/<node_id>`` with a key
bound to a lease that a ``Registration`` keeps alive; a ``Membership`` mirrors
every key under a prefix and notifies listeners of joins, updates and leaves.
Both survive etcd restarts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvmesh.services.common.etcd import EtcdClient, EtcdClosed, EtcdError, WatchEvent

log = logging.getLogger(__name__)

_MAX_BACKOFF = 1.0


def nodes_prefix(cluster: str) -> str:
    """``/kvmesh/<cluster>/nodes/``: prefix of every node key of a cluster."""
    return f"/kvmesh/{cluster}/nodes/"


def node_key(cluster: str, role: str, node_id: str) -> str:
    """``/kvmesh/<cluster>/nodes/<role>/<node_id>``."""
    return f"{nodes_prefix(cluster)}{role}/{node_id}"


class Registration:
    """Keeps ``key`` = ``value`` in etcd for as long as this process lives.

    ``start()`` grants a lease of ``ttl`` seconds, puts the key under it and starts
    a background task that refreshes the lease every ``ttl/3`` s over one long-lived
    ``LeaseKeepAlive`` stream. On stream failure (e.g. etcd restarting) it
    reconnects with backoff (capped at 1 s); if the lease is gone (expired or
    revoked) it grants a new one and puts the key again. ``stop()`` revokes the
    lease, which deletes the key; if etcd is down the key expires after ``ttl``.
    """

    def __init__(self, client: EtcdClient, key: str, value: bytes, ttl: int = 10):
        self.client, self.key, self.value, self.ttl = client, key, value, ttl
        self.lease_id: int | None = None
        self._task: asyncio.Task | None = None
        self._registered = False

    @property
    def registered(self) -> bool:
        """True while the key is believed to be held (last known lease alive)."""
        return self._registered

    async def start(self) -> None:
        """Register (raises ``EtcdError`` if etcd is unreachable) and start the keepalive task."""
        await self._register()
        self._task = asyncio.create_task(self._keepalive_loop(), name=f"etcd-keepalive:{self.key}")

    async def _register(self) -> int:
        lease_id = await self.client.lease_grant(self.ttl)
        await self.client.put(self.key, self.value, lease=lease_id)
        self.lease_id, self._registered = lease_id, True
        log.info("registered %s (lease %x)", self.key, lease_id)
        return lease_id

    async def update(self, value: bytes) -> None:
        """Replace the value, keeping the current lease (also used on re-registration)."""
        self.value = value
        if self.lease_id is not None:
            await self.client.put(self.key, value, lease=self.lease_id)

    async def _keepalive_loop(self) -> None:
        interval = max(self.ttl / 3, 0.1)
        backoff = 0.1
        while True:
            stream = None
            try:
                lease_id = self.lease_id
                if lease_id is None:
                    lease_id = await self._register()
                stream = await self.client.lease_keepalive_stream()
                while True:
                    ttl = await stream.keepalive(lease_id)
                    if ttl <= 0:
                        log.warning("lease %x of %s expired; re-registering", lease_id, self.key)
                        self.lease_id, self._registered = None, False
                        lease_id = await self._register()
                        continue
                    self._registered = True
                    backoff = 0.1
                    await asyncio.sleep(interval)
            except EtcdClosed:
                self._registered = False
                return
            except EtcdError as e:
                log.warning("keepalive for %s failed: %s; retrying in %.1fs", self.key, e, backoff)
            finally:
                if stream is not None:
                    stream.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF)

    async def stop(self) -> None:
        """Stop keeping the lease alive and revoke it (tolerates etcd being down)."""
        if self._task is not None:
            await _cancel(self._task, f"keepalive of {self.key}")
            self._task = None
        if self.lease_id is not None:
            try:
                await self.client.lease_revoke(self.lease_id)
            except EtcdError as e:
                log.warning("could not revoke lease of %s (it will expire): %s", self.key, e)
            self.lease_id = None
        self._registered = False


async def _cancel(task: asyncio.Task, what: str) -> None:
    """Cancels ``task`` and waits for it; a failure it had ended with is logged."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:  # broad on purpose: stopping must finish; the task's failure is a bug
        log.exception("%s had failed", what)


Listener = Callable[[str, str, "bytes | None"], None]


class Membership:
    """Live view of all keys under ``prefix`` (e.g. ``nodes_prefix(cluster)``).

    ``start()`` lists the prefix, then watches from the listing's revision + 1,
    re-listing if the watch history was compacted. ``nodes`` maps key -> value.
    Listeners are called as ``cb(event, key, value)`` with event ``"join"``,
    ``"update"`` or ``"leave"`` (``value`` None on leave).
    """

    def __init__(self, client: EtcdClient, prefix: str):
        self.client, self.prefix = client, prefix
        self.nodes: dict[str, bytes] = {}
        self._listeners: list[Listener] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    def add_listener(self, cb: Listener) -> None:
        self._listeners.append(cb)

    async def start(self) -> None:
        """Initial listing (raises ``EtcdError`` if etcd is unreachable), then watch in background."""
        revision = await self._relist()
        self._task = asyncio.create_task(self._run(revision), name=f"etcd-membership:{self.prefix}")

    async def stop(self) -> None:
        if self._task is not None:
            await _cancel(self._task, f"membership watch of {self.prefix}")
            self._task = None

    async def wait_for(self, predicate: Callable[[dict[str, bytes]], bool], timeout: float) -> bool:
        """Wait until ``predicate(nodes)`` holds; returns False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self.nodes):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
            except TimeoutError:
                return predicate(self.nodes)
        return True

    def _notify(self, event: str, key: str, value: bytes | None) -> None:
        if value is None:
            self.nodes.pop(key, None)
        else:
            self.nodes[key] = value
        self._changed.set()
        self._changed = asyncio.Event()
        for cb in list(self._listeners):
            try:
                cb(event, key, value)
            except Exception:  # broad on purpose: one listener's bug must not stop the view
                log.exception("membership listener failed on %s %s", event, key)

    def _apply(self, ev: WatchEvent) -> None:
        if ev.type == "put":
            old = self.nodes.get(ev.key)
            if old is None:
                self._notify("join", ev.key, ev.value)
            elif old != ev.value:
                self._notify("update", ev.key, ev.value)
        elif ev.type == "delete" and ev.key in self.nodes:
            self._notify("leave", ev.key, None)

    async def _relist(self) -> int:
        items, revision = await self.client.get_prefix(self.prefix)
        fresh = dict(items)
        for key in [k for k in self.nodes if k not in fresh]:
            self._notify("leave", key, None)
        for key, value in items:
            self._apply(WatchEvent("put", key, value, revision))
        return revision

    async def _run(self, revision: int) -> None:
        backoff = 0.1
        while True:
            try:
                async for ev in self.client.watch_prefix(self.prefix, revision + 1):
                    if ev.type == "reset":
                        log.warning("membership watch on %s compacted; re-listing", self.prefix)
                        break
                    self._apply(ev)
                    revision = ev.mod_revision
                    backoff = 0.1
                revision = await self._relist()
            except EtcdClosed:
                return
            except EtcdError as e:
                log.warning(
                    "membership watch on %s failed: %s; retrying in %.1fs", self.prefix, e, backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
