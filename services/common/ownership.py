"""Who owns a decode node's reservations: a conductor's *owner key*, apart from its
registration key.

A conductor puts ``/kvmesh/<cluster>/owners/conductor/<node_id>`` under a lease of its
own, its value a per-process *incarnation* id (a uuid), and sends both in gRPC metadata
on ``Reserve`` (``kvmesh-conductor``, ``kvmesh-conductor-incarnation``). It deletes the
owner key only in teardown, AFTER its drain -- not when it deregisters at the start of a
graceful shutdown, while it still serves the requests it holds reservations for.

A decode node (:class:`Owners`) frees the reservations of an incarnation once that
incarnation has ended: its owner key was deleted or expired (the process is gone), or
it was put again with another incarnation (the conductor restarted under the same node
id before its old lease ran out). A reservation whose incarnation is the owner key's
value is *owned*: the reaper gives it longer (see ``decode.server``).

Torch-free: imported by the conductor and the decode node alike."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from kvmesh.services.common.etcd import EtcdClient
from kvmesh.services.common.registry import Membership, Registration

log = logging.getLogger(__name__)

# gRPC metadata a conductor sends the decode node: on Reserve, its node id and its
# incarnation (the owner of the reservation); on Release, the prefill nodes it asked to
# write the reserved blocks (a JSON list)
CONDUCTOR_MD = "kvmesh-conductor"
INCARNATION_MD = "kvmesh-conductor-incarnation"
WRITERS_MD = "kvmesh-prefill-writers"


def owners_prefix(cluster: str) -> str:
    """``/kvmesh/<cluster>/owners/``: prefix of every owner key of a cluster."""
    return f"/kvmesh/{cluster}/owners/"


def owner_key(cluster: str, role: str, node_id: str) -> str:
    """``/kvmesh/<cluster>/owners/<role>/<node_id>``."""
    return f"{owners_prefix(cluster)}{role}/{node_id}"


def new_incarnation() -> str:
    """A fresh per-process incarnation id."""
    return uuid.uuid4().hex


class OwnerKey:
    """The owner key of one process, under its own lease (kept alive, put again if the
    lease is lost): started once the process serves, stopped after its drain."""

    def __init__(
        self, client: EtcdClient, cluster: str, role: str, node_id: str, ttl: int = 10
    ) -> None:
        self.incarnation = new_incarnation()
        self.key = owner_key(cluster, role, node_id)
        self._reg = Registration(client, self.key, self.incarnation.encode(), ttl=ttl)

    def metadata(self, node_id: str) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata naming this owner on ``Reserve``."""
        return ((CONDUCTOR_MD, node_id), (INCARNATION_MD, self.incarnation))

    async def start(self) -> None:
        await self._reg.start()

    async def stop(self) -> None:
        """Deletes the key (revokes its lease; it expires on its own if etcd is down)."""
        await self._reg.stop()


# (owner node id, its incarnation that ended)
Ended = Callable[[str, str], None]


class Owners:
    """A decode node's live view of the conductors' owner keys: ``alive(id, inc)`` and a
    callback for every incarnation that ends (key deleted or put with another value)."""

    ROLE = "conductor"

    def __init__(self, client: EtcdClient, cluster: str, on_ended: Ended) -> None:
        self._prefix = f"{owners_prefix(cluster)}{self.ROLE}/"
        self.membership = Membership(client, owners_prefix(cluster))
        self.current: dict[str, str] = {}  # owner node id -> incarnation
        self._on_ended = on_ended
        self.membership.add_listener(self._on_event)

    def alive(self, owner: str, incarnation: str) -> bool:
        """Whether ``incarnation`` is ``owner``'s live one, as far as the watch has seen."""
        return bool(incarnation) and self.current.get(owner) == incarnation

    def _on_event(self, event: str, key: str, value: bytes | None) -> None:
        if not key.startswith(self._prefix):
            return
        owner = key[len(self._prefix) :]
        old = self.current.pop(owner, None)
        if value is not None:
            self.current[owner] = value.decode(errors="replace")
        if old is not None and old != self.current.get(owner):
            log.info(
                "conductor %s incarnation %s ended (%s)",
                owner,
                old,
                "left" if value is None else "restarted",
            )
            self._on_ended(owner, old)

    async def start(self) -> None:
        await self.membership.start()

    async def stop(self) -> None:
        await self.membership.stop()
