"""The prefill nodes in order of queued time, kept current as their queues change, so
that picking the least-queued candidates for a request costs the candidates, not the
cluster (a sort of every node per decision was the conductor's largest cost at 64
nodes).

- :class:`NodeMap`: the scheduler's ``prefill`` dict; it counts its changes of
  membership, so that the order is rebuilt when a node joins, leaves or is replaced.
- :class:`QueueOrder`: ``(queue_ms, node_id)`` of every node, sorted. A node state tells
  the orders that hold it when its ``queue_ms`` changes (``moved``); the order
  repositions it before the next pick.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any, Protocol, TypeVar

from kvmesh.services.conductor import _sorted

V = TypeVar("V")


class NodeMap(dict[str, V]):
    """A dict that counts the calls that change its keys or values (``version``)."""

    version = 0

    def __setitem__(self, key: str, value: V) -> None:
        dict.__setitem__(self, key, value)
        self.version += 1

    def __delitem__(self, key: str) -> None:
        dict.__delitem__(self, key)
        self.version += 1

    def pop(self, *args: Any) -> Any:
        self.version += 1
        return dict.pop(self, *args)

    def popitem(self) -> tuple[str, V]:
        self.version += 1
        return dict.popitem(self)

    def clear(self) -> None:
        self.version += 1
        dict.clear(self)

    def setdefault(self, key: str, default: Any = None) -> Any:
        self.version += 1
        return dict.setdefault(self, key, default)

    def update(self, *args: Any, **kw: Any) -> None:
        self.version += 1
        dict.update(self, *args, **kw)

    def __ior__(self, other: Any) -> NodeMap[V]:  # type: ignore[override,misc]
        self.update(other)
        return self


class _Queued(Protocol):
    node_id: str
    queue_ms: float
    _orders: tuple[QueueOrder, ...]


class QueueOrder:
    """The nodes of one :class:`NodeMap`, least queued first (ties by node id)."""

    def __init__(self) -> None:
        self.keys: list[tuple[float, str]] = []
        self._key_of: dict[str, tuple[float, str]] = {}
        self._dirty: dict[str, _Queued] = {}
        self._version = -1
        self._of: Mapping[str, _Queued] | None = None

    def moved(self, state: _Queued) -> None:
        """``state.queue_ms`` changed: reposition it before the next pick."""
        self._dirty[state.node_id] = state

    def _rebuild(self, nodes: NodeMap[Any]) -> None:
        self._of, self._version = nodes, nodes.version
        self._dirty.clear()
        self._key_of = {}
        for state in nodes.values():
            if self not in state._orders:
                state._orders = (*state._orders, self)
            self._key_of[state.node_id] = (state.queue_ms, state.node_id)
        self.keys = sorted(self._key_of.values())

    def sync(self, nodes: NodeMap[Any]) -> None:
        """Brings the order up to date with ``nodes``: rebuilt if its membership changed,
        else only the nodes whose queue moved are repositioned."""
        if nodes is not self._of or nodes.version != self._version:
            self._rebuild(nodes)
            return
        dirty, keys, key_of = self._dirty, self.keys, self._key_of
        for nid, state in dirty.items():
            if nodes.get(nid) is not state:  # a node this order no longer holds
                continue
            old = key_of[nid]
            new = (state.queue_ms, nid)
            if new == old:
                continue
            i = _sorted.bisect_left_key(keys, old)
            if i < len(keys) and keys[i] is old:
                del keys[i]
            else:  # pragma: no cover - a NaN queue time: found by identity
                keys.remove(old)
            _sorted.insort_key(keys, new)
            key_of[nid] = new
        dirty.clear()

    def least(self, nodes: NodeMap[V], k: int, skip: Container[str]) -> list[V]:
        """The ``k`` least queued of ``nodes`` whose ids are not in ``skip``, least
        first (call ``sync`` first)."""
        out: list[V] = []
        if k <= 0:
            return out
        for _, nid in self.keys:
            if nid not in skip:
                out.append(nodes[nid])
                if len(out) == k:
                    break
        return out
