"""Minimal asyncio etcd v3 client on ``grpc.aio`` (no third-party etcd package).

Covers what kvmesh needs: KV get/put/delete (single key and prefix), leases
(grant/revoke/TTL and a long-lived keepalive stream) and prefix watches that
survive etcd restarts. All gRPC failures surface as ``EtcdError`` (or its
subclasses ``EtcdUnavailable`` / ``EtcdClosed``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

import grpc
import grpc.aio

from kvmesh.protos.etcd import rpc_pb2, rpc_pb2_grpc

log = logging.getLogger(__name__)

_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,  # our channel was closed under us (endpoint failover)
    grpc.StatusCode.UNKNOWN,  # etcd shutting down mid-stream
}
_CHANNEL_OPTIONS = [
    # Reconnect quickly after an etcd restart (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Detect dead peers on idle streams; etcd's default --grpc-keepalive-min-time is 5 s.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


class EtcdError(Exception):
    """An etcd request failed. ``code`` is the gRPC status code, if any."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError):
    """etcd could not be reached (down, restarting, or timed out). Safe to retry."""


class EtcdClosed(EtcdError):
    """The client was closed."""


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by ``EtcdClient.watch_prefix``.

    ``type`` is ``"put"``, ``"delete"`` (``value`` is ``b""``) or ``"reset"``: the
    requested history was compacted, so the consumer must re-list the prefix and
    start a new watch (``mod_revision`` is the compaction revision, ``key`` the
    watched prefix). ``"reset"`` is always the last event of its iterator.
    """

    type: Literal["put", "delete", "reset"]
    key: str
    value: bytes
    mod_revision: int


def _b(s: str | bytes) -> bytes:
    return s.encode() if isinstance(s, str) else s


def prefix_range_end(prefix: bytes) -> bytes:
    """The etcd ``range_end`` that selects every key starting with ``prefix``."""
    b = bytearray(prefix)
    for i in reversed(range(len(b))):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"  # all keys


def _normalize(endpoint: str) -> str:
    for scheme in ("http://", "https://"):
        if endpoint.startswith(scheme):
            endpoint = endpoint[len(scheme) :]
    return endpoint.rstrip("/")


class LeaseKeepAliveStream:
    """One long-lived bidirectional ``Lease.LeaseKeepAlive`` stream.

    Obtain with ``EtcdClient.lease_keepalive_stream()``; call ``keepalive(lease_id)``
    repeatedly, ``close()`` when done. Any stream failure raises ``EtcdError``; the
    stream is then dead and a new one must be opened.
    """

    def __init__(
        self, client: EtcdClient, call: grpc.aio.StreamStreamCall, channel: grpc.aio.Channel
    ):
        self._client, self._call, self._channel = client, call, channel

    async def keepalive(self, lease_id: int) -> int:
        """Refresh ``lease_id``; returns its new TTL in seconds (<= 0: the lease no longer exists)."""
        try:
            await self._call.write(rpc_pb2.LeaseKeepAliveRequest(ID=lease_id))
            async with asyncio.timeout(self._client.timeout):
                resp = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise self._client._error(e, self._channel) from None
        except (asyncio.InvalidStateError, TimeoutError) as e:
            raise EtcdUnavailable(f"lease keepalive stream broken: {e!r}") from None
        if resp is grpc.aio.EOF:
            raise EtcdUnavailable("lease keepalive stream closed by server")
        return resp.TTL

    def close(self) -> None:
        self._call.cancel()


def etcd_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials | None:
    """TLS credentials for etcd from PEM files (``--etcd-ca/--etcd-cert/--etcd-key``);
    None when none is set (plaintext)."""
    if not (ca or cert):
        return None

    def read(path: str) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


class EtcdClient:
    """Asyncio etcd v3 client.

    ``endpoints`` is a list of ``host:port`` (an ``http://`` prefix is accepted) or a
    comma-separated string; on ``UNAVAILABLE`` the client fails over to the next
    endpoint for subsequent calls. Unary calls wait up to ``timeout`` for a
    (re)connection before raising ``EtcdUnavailable``. With ``user``/``password`` it authenticates via
    ``Auth.Authenticate`` and sends the token as ``token`` metadata, re-authenticating
    once when the token is rejected. ``timeout`` applies to every unary call.
    The channel is created lazily; ``connect()`` just does it eagerly (and
    authenticates). Usable as ``async with EtcdClient(...) as c``.
    """

    def __init__(
        self,
        endpoints: list[str] | str,
        *,
        user: str | None = None,
        password: str | None = None,
        timeout: float = 5.0,
        credentials: grpc.ChannelCredentials | None = None,
    ):
        if isinstance(endpoints, str):
            endpoints = endpoints.split(",")
        self.endpoints = [_normalize(e.strip()) for e in endpoints if e.strip()]
        if not self.endpoints:
            raise ValueError("no etcd endpoints given")
        self.user, self.password, self.timeout = user, password, timeout
        self.credentials = credentials  # TLS to etcd (see ``etcd_credentials``); None = plaintext
        self._idx = 0
        self._channel: grpc.aio.Channel | None = None
        self._token: str | None = None
        self._closed = False
        self._closing: set[asyncio.Task] = set()  # old channels being closed after failover

    # ---- connection management -------------------------------------------------

    def _ensure_channel(self) -> grpc.aio.Channel:
        if self._closed:
            raise EtcdClosed("etcd client is closed")
        if self._channel is None:
            if self.credentials is not None:
                self._channel = grpc.aio.secure_channel(
                    self.endpoints[self._idx], self.credentials, options=_CHANNEL_OPTIONS
                )
            else:
                self._channel = grpc.aio.insecure_channel(
                    self.endpoints[self._idx], options=_CHANNEL_OPTIONS
                )
            self._kv = rpc_pb2_grpc.KVStub(self._channel)
            self._lease = rpc_pb2_grpc.LeaseStub(self._channel)
            self._watch = rpc_pb2_grpc.WatchStub(self._channel)
            self._auth = rpc_pb2_grpc.AuthStub(self._channel)
            self._maint = rpc_pb2_grpc.MaintenanceStub(self._channel)
        return self._channel

    def _error(self, e: grpc.aio.AioRpcError, channel: grpc.aio.Channel | None = None) -> EtcdError:
        """Translate a gRPC error; fail over / drop the auth token as a side effect."""
        code, details = e.code(), e.details()
        msg = f"etcd {self.endpoints[self._idx]}: {code.name}: {details}"
        if code == grpc.StatusCode.UNAUTHENTICATED or "auth token" in (details or ""):
            self._token = None
        if code in _RETRYABLE:
            if self._closed:
                return EtcdClosed("etcd client is closed", code)
            current = self._channel
            if len(self.endpoints) > 1 and channel is current and current is not None:
                self._idx = (self._idx + 1) % len(self.endpoints)
                self._channel, self._token = None, None
                task = asyncio.get_running_loop().create_task(current.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            return EtcdUnavailable(msg, code)
        return EtcdError(msg, code)

    async def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        if self.user is None:
            return None
        if self._token is None:
            channel = self._ensure_channel()
            try:
                resp = await self._auth.Authenticate(
                    rpc_pb2.AuthenticateRequest(name=self.user, password=self.password or ""),
                    timeout=self.timeout,
                    wait_for_ready=True,
                )
            except grpc.aio.AioRpcError as e:
                raise self._error(e, channel) from None
            self._token = resp.token
        return (("token", self._token),)

    async def _unary(self, service: str, method: str, request):
        """Call a unary RPC with timeout, auth metadata and error translation."""
        for attempt in range(2):
            channel = self._ensure_channel()
            md = await self._metadata()
            try:
                # wait_for_ready: ride out brief reconnects (etcd restart) up to the timeout
                # instead of failing fast while the channel is in reconnect backoff.
                rpc = getattr(getattr(self, service), method)
                return await rpc(request, timeout=self.timeout, metadata=md, wait_for_ready=True)
            except grpc.aio.AioRpcError as e:
                err = self._error(e, channel)
                if (
                    attempt == 0
                    and self.user is not None
                    and self._token is None
                    and not isinstance(err, EtcdUnavailable)
                ):
                    continue  # token expired/invalid (e.g. etcd restarted): re-authenticate once
                raise err from None
        raise AssertionError("unreachable")

    async def connect(self) -> EtcdClient:
        """Create the channel now (and authenticate when credentials are set)."""
        self._ensure_channel()
        await self._metadata()
        return self

    async def close(self) -> None:
        """Close the channel; pending streams end with ``EtcdClosed``."""
        self._closed = True
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()

    async def __aenter__(self) -> EtcdClient:
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- KV ----------------------------------------------------------------------

    async def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        """Store ``key`` = ``value`` (optionally attached to ``lease``); returns the new revision."""
        resp = await self._unary(
            "_kv", "Put", rpc_pb2.PutRequest(key=_b(key), value=_b(value), lease=lease)
        )
        return resp.header.revision

    async def get(self, key: str) -> bytes | None:
        """Value of ``key``, or None if absent."""
        resp = await self._unary("_kv", "Range", rpc_pb2.RangeRequest(key=_b(key)))
        return resp.kvs[0].value if resp.kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[tuple[str, bytes]], int]:
        """All ``(key, value)`` under ``prefix`` sorted by key, plus the store revision of the read."""
        p = _b(prefix)
        resp = await self._unary(
            "_kv", "Range", rpc_pb2.RangeRequest(key=p, range_end=prefix_range_end(p))
        )
        return [(kv.key.decode(), kv.value) for kv in resp.kvs], resp.header.revision

    async def delete(self, key: str) -> int:
        """Delete ``key``; returns the number of keys deleted (0 or 1)."""
        resp = await self._unary("_kv", "DeleteRange", rpc_pb2.DeleteRangeRequest(key=_b(key)))
        return resp.deleted

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns the number deleted."""
        p = _b(prefix)
        resp = await self._unary(
            "_kv", "DeleteRange", rpc_pb2.DeleteRangeRequest(key=p, range_end=prefix_range_end(p))
        )
        return resp.deleted

    async def create(
        self, key: str, value: bytes | str, lease: int = 0, also: dict[str, bytes] | None = None
    ) -> tuple[bool, bytes | None, int]:
        """One transaction: if ``key`` does not exist (its create_revision is 0), put
        ``key`` = ``value`` and every ``also`` key, all under ``lease``; else read ``key``.
        Returns ``(created, value of key now, store revision of the transaction)`` - the
        building block of a leader election (campaign key under the candidate's lease)."""
        k = _b(key)
        puts = [rpc_pb2.PutRequest(key=k, value=_b(value), lease=lease)]
        puts += [
            rpc_pb2.PutRequest(key=_b(a), value=_b(v), lease=lease) for a, v in (also or {}).items()
        ]
        req = rpc_pb2.TxnRequest(
            compare=[
                rpc_pb2.Compare(
                    result=rpc_pb2.Compare.EQUAL,
                    target=rpc_pb2.Compare.CREATE,
                    key=k,
                    create_revision=0,
                )
            ],
            success=[rpc_pb2.RequestOp(request_put=p) for p in puts],
            failure=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=k))],
        )
        resp = await self._unary("_kv", "Txn", req)
        if resp.succeeded:
            return True, _b(value), resp.header.revision
        kvs = resp.responses[0].response_range.kvs if resp.responses else []
        return False, (kvs[0].value if kvs else None), resp.header.revision

    async def compact(self, revision: int) -> None:
        """Compact the key-value history up to ``revision`` (mainly for tests/ops)."""
        await self._unary(
            "_kv", "Compact", rpc_pb2.CompactionRequest(revision=revision, physical=True)
        )

    # ---- leases --------------------------------------------------------------------

    async def lease_grant(self, ttl: int) -> int:
        """Grant a lease of ``ttl`` seconds (etcd may raise it to its minimum); returns its ID."""
        resp = await self._unary("_lease", "LeaseGrant", rpc_pb2.LeaseGrantRequest(TTL=ttl))
        if resp.error:
            raise EtcdError(f"lease grant failed: {resp.error}")
        return resp.ID

    async def lease_revoke(self, lease_id: int) -> bool:
        """Revoke a lease, deleting its keys. Returns False if the lease did not exist."""
        try:
            await self._unary("_lease", "LeaseRevoke", rpc_pb2.LeaseRevokeRequest(ID=lease_id))
        except EtcdError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def lease_ttl(self, lease_id: int) -> int:
        """Remaining TTL in seconds of a lease, or -1 if it does not exist (expired/revoked)."""
        try:
            resp = await self._unary(
                "_lease", "LeaseTimeToLive", rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id)
            )
        except EtcdError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return -1
            raise
        return resp.TTL

    async def lease_keepalive_stream(self) -> LeaseKeepAliveStream:
        """Open a bidirectional keepalive stream (see ``LeaseKeepAliveStream``)."""
        channel = self._ensure_channel()
        md = await self._metadata()
        return LeaseKeepAliveStream(self, self._lease.LeaseKeepAlive(metadata=md), channel)

    # ---- watch ---------------------------------------------------------------------

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Yield every change under ``prefix`` from ``start_revision`` (inclusive) on, forever.

        Connection failures (e.g. an etcd restart) are retried with backoff (capped
        at 1 s); the watch is re-created from the last seen revision + 1, so events
        are neither replayed nor lost. If that history was compacted, a final
        ``WatchEvent("reset", ...)`` is yielded and the iterator ends: re-list and
        watch again from the listing's revision + 1. Non-retryable failures raise
        ``EtcdError``; ``EtcdClosed`` once the client is closed.
        """
        p = _b(prefix)
        next_rev = start_revision
        backoff = 0.05
        while True:
            call = None
            try:
                channel = self._ensure_channel()
                md = await self._metadata()
                call = self._watch.Watch(metadata=md)
                create = rpc_pb2.WatchCreateRequest(
                    key=p, range_end=prefix_range_end(p), start_revision=next_rev
                )
                await call.write(rpc_pb2.WatchRequest(create_request=create))
                while True:
                    resp = await call.read()
                    if resp is grpc.aio.EOF:
                        raise EtcdUnavailable("watch stream closed by server")
                    if resp.compact_revision:
                        yield WatchEvent("reset", prefix, b"", resp.compact_revision)
                        return
                    if resp.canceled:
                        raise EtcdError(
                            f"watch canceled by etcd: {resp.cancel_reason or 'no reason given'}"
                        )
                    if resp.created:
                        backoff = 0.05
                    for ev in resp.events:
                        is_put = ev.type == ev.PUT
                        yield WatchEvent(
                            "put" if is_put else "delete",
                            ev.kv.key.decode(),
                            ev.kv.value if is_put else b"",
                            ev.kv.mod_revision,
                        )
                        next_rev = ev.kv.mod_revision + 1
            except grpc.aio.AioRpcError as e:
                err = self._error(e, channel)
                if not isinstance(err, EtcdUnavailable) and not (self.user and self._token is None):
                    raise err from None
                log.debug("watch %s: %s; retrying in %.2fs", prefix, err, backoff)
            except asyncio.InvalidStateError:
                log.debug("watch %s: stream finished; retrying in %.2fs", prefix, backoff)
            except EtcdUnavailable as err:
                log.debug("watch %s: %s; retrying in %.2fs", prefix, err, backoff)
            finally:
                if call is not None:
                    call.cancel()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)
