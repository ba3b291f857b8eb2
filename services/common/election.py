"""Leader election on etcd: one of several processes of a role leads, the others stand by.

A candidate grants a lease and, in ONE transaction, creates the campaign key
``/kvmesh/<cluster>/leader/<role>`` (compare create_revision == 0) together with its node
key ``/kvmesh/<cluster>/nodes/<role>/<id>``, both under that lease. So the node key of a
role that elects exists only for its leader: everything that finds a service through the
registry (``Membership``) follows the leader without knowing about the election. A
standby watches the campaign key and campaigns again when it is deleted - when the
leader's lease lapses (it died: at most ``ttl`` s later) or is revoked (it stopped).

A leader keeps its lease alive over one keepalive stream. If etcd says the lease is gone
(etcd was down longer than the TTL) it takes the key again when no one else holds it, and
keeps its state; if another process leads by then, it has lost: ``on_lost`` runs once.
A leader whose keepalives stop reaching etcd (cut off from it, etcd down) stands down
(``leading`` cleared) when its lease may have lapsed - the TTL after the last keepalive
etcd answered was sent - which is no later than a standby can take the key; it leads
again once a keepalive lands (the lease was still alive) or it takes the key again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from kvmesh.services.common.etcd import EtcdClient, EtcdClosed, EtcdError

log = logging.getLogger(__name__)

_MAX_BACKOFF = 1.0


def leader_key(cluster: str, role: str) -> str:
    """``/kvmesh/<cluster>/leader/<role>``: the campaign key; its value is the leader's
    node info (JSON, as its registration)."""
    return f"/kvmesh/{cluster}/leader/{role}"


async def current_leader(client: EtcdClient, cluster: str, role: str) -> dict | None:
    """The node info of the role's leader, or None while there is none."""
    raw = await client.get(leader_key(cluster, role))
    return json.loads(raw) if raw else None


class LeaderElection:
    """Campaigns for ``key`` with ``node_key`` = ``value`` beside it (see the module doc).

    Has the interface of a :class:`~kvmesh.services.common.registry.Registration`
    (``start``/``update``/``stop``/``registered``/``lease_id``), so a service can use it
    in place of one: ``start()`` returns at once and campaigns in the background;
    ``leading`` is an event set while this process leads."""

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        node_key: str,
        value: bytes,
        ttl: int = 10,
        on_lead: Callable[[], None] | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.client, self.key, self.node_key, self.value, self.ttl = (
            client,
            key,
            node_key,
            value,
            ttl,
        )
        self.on_lead, self.on_lost = on_lead, on_lost
        self.lease_id: int | None = None
        self.leading = asyncio.Event()
        self.leader: bytes | None = None  # the leader's value, as last seen
        self._task: asyncio.Task | None = None
        self._expiry: asyncio.TimerHandle | None = None  # when our lease may lapse

    def _hold_until(self, deadline: float) -> None:
        """Leads until ``deadline`` (loop time) unless a later keepalive extends it: etcd
        counts the lease's TTL from when it got a keepalive, after we sent it."""
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_at(deadline, self._expire)
        if not self.leading.is_set():
            self.leading.set()

    def _expire(self) -> None:
        self._expiry = None
        if self.leading.is_set():
            log.error(
                "no keepalive of %s reached etcd within the lease TTL; standing down "
                "(a standby may lead now) until the lease is renewed or the key retaken",
                self.key,
            )
            self.leading.clear()

    def _stand_down(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self.leading.clear()

    @property
    def registered(self) -> bool:
        return self.leading.is_set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"etcd-election:{self.key}")

    async def _try(self) -> tuple[bool, int]:
        """One campaign transaction under a fresh lease; (won, revision). A win leads
        until the lease's TTL from its grant has run (see :meth:`_hold_until`)."""
        sent = asyncio.get_running_loop().time()
        lease = await self.client.lease_grant(self.ttl)
        try:
            won, cur, rev = await self.client.create(
                self.key, self.value, lease, also={self.node_key: self.value}
            )
        except BaseException:
            await self._revoke(lease)
            raise
        if won:
            self.lease_id, self.leader = lease, self.value
            self._hold_until(sent + self.ttl)
        else:
            self.leader = cur
            await self._revoke(lease)
        return won, rev

    async def _revoke(self, lease: int) -> None:
        try:
            await self.client.lease_revoke(lease)
        except EtcdError as e:  # it expires by itself
            log.debug("revoking unused lease %x: %s", lease, e)

    async def _wait_vacant(self, revision: int) -> None:
        """Returns once the campaign key is deleted after ``revision`` (or the watch's
        history was compacted: campaign again and see)."""
        async for ev in self.client.watch_prefix(self.key, revision + 1):
            if ev.type == "reset" or (ev.key == self.key and ev.type == "delete"):
                return
            if ev.key == self.key:
                self.leader = ev.value

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                won, rev = await self._try()
                if won:
                    break
                log.info("standing by: %s leads", _name(self.leader))
                await self._wait_vacant(rev)
                backoff = 0.1
                continue
            except EtcdClosed:
                return
            except EtcdError as e:
                log.warning("campaign for %s failed: %s; retrying in %.1fs", self.key, e, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF)
        log.info("leading %s (lease %x)", self.key, self.lease_id)
        if self.on_lead is not None:
            self.on_lead()
        await self._keepalive()

    async def _keepalive(self) -> None:
        interval = max(self.ttl / 3, 0.1)
        backoff = 0.1
        while True:
            stream = None
            try:
                stream = await self.client.lease_keepalive_stream()
                while True:
                    if self.lease_id is None:
                        won, _ = await self._try()
                        if not won:
                            log.error("lost %s to %s", self.key, _name(self.leader))
                            self._stand_down()
                            if self.on_lost is not None:
                                self.on_lost()
                            return
                        log.warning("took %s again under a new lease", self.key)
                    lease_id = self.lease_id
                    assert lease_id is not None  # won above, or held from before
                    sent = asyncio.get_running_loop().time()
                    ttl = await stream.keepalive(lease_id)
                    if ttl <= 0:
                        log.warning("lease of %s lapsed; taking it again if vacant", self.key)
                        self._stand_down()
                        self.lease_id = None
                        continue
                    if not self.leading.is_set():
                        log.warning("keepalives of %s reach etcd again; leading", self.key)
                    self._hold_until(sent + ttl)
                    backoff = 0.1
                    await asyncio.sleep(interval)
            except EtcdClosed:
                return
            except EtcdError as e:
                log.warning("keepalive for %s failed: %s; retrying in %.1fs", self.key, e, backoff)
            finally:
                if stream is not None:
                    stream.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF)

    async def update(self, value: bytes) -> None:
        """New node info: the next campaign writes it; a leader rewrites both keys now."""
        self.value = value
        if self.leading.is_set() and self.lease_id is not None:
            try:
                await self.client.put(self.key, value, lease=self.lease_id)
                await self.client.put(self.node_key, value, lease=self.lease_id)
            except EtcdError as e:
                # the lease just lapsed, or etcd is out of reach: the keepalive loop finds
                # out and stands down or campaigns again, with the new value
                log.warning(
                    "could not rewrite %s with new node info (%s); the keepalive loop will recover",
                    self.key,
                    e,
                )

    async def stop(self) -> None:
        """Stops campaigning; a leader revokes its lease, which deletes both keys at once,
        so a standby takes over without waiting for the TTL."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # broad on purpose: stopping must finish
                log.exception("election task for %s had failed", self.key)
            self._task = None
        self._stand_down()
        if self.lease_id is not None:
            lease, self.lease_id = self.lease_id, None
            try:
                await self.client.lease_revoke(lease)
            except EtcdError as e:
                log.warning("could not revoke the lease of %s (it will expire): %s", self.key, e)


def _name(value: bytes | None) -> str:
    if not value:
        return "nobody"
    try:
        info = json.loads(value)
    except ValueError:
        return repr(value[:60])
    return f"{info.get('id', '?')} at {info.get('grpc', '?')}"
