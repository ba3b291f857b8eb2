"""Client authentication (API keys) and tenant isolation of the prefix cache.

**API keys** (conductor ``--api-keys`` and/or ``--api-keys-file``). Each entry is one of::

    KEY                      the default tenant
    KEY:TENANT               tenant TENANT, its own cache namespace
    KEY:TENANT:shared=NS     tenant TENANT, cache namespace "shared NS": every tenant whose
                             keys say shared=NS hits (and may time) the others' prefixes

``--api-keys`` takes entries comma-separated; the file has one entry per line (``#``
comments and blank lines are skipped). Keys may not contain ``:``, ``,`` or whitespace.
With no key configured the API is open (a dev cluster) and every request belongs to the
default tenant. Clients send ``authorization: Bearer KEY`` -- as gRPC metadata or as
the HTTP header; a missing or unknown key gets UNAUTHENTICATED (HTTP 401).

The gRPC check is a server interceptor on the conductor's client-facing service only
(``/kvmesh.v1.Conductor/*``); the nodes' internal RPCs are protected by mutual TLS instead.

**Tenant isolation.** The request's cache namespace enters the seed of its prefix hashes
(:func:`tenant_seed`, in ``Conductor.generate``), ahead of the request's own
``cache_salt``: equal prompts of two tenants get unrelated block hashes, so one tenant
can never hit -- nor time -- another's cached prefix, unless both opted into the same
shared namespace. The default namespace adds nothing to the seed (hashes of an open
cluster are unchanged); any other one adds ``0xFF`` + its length + its name: a UTF-8
``cache_salt`` can never contain the byte 0xFF, so no salt can forge another namespace.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from kvmesh.services.common.config import ConfigError
from kvmesh.services.common.interceptors import wrap_handler

log = logging.getLogger(__name__)

DEFAULT_TENANT = ""
PROTECTED_SERVICE = "Conductor"  # the client API (``kvmesh.v1.Conductor``)


def _protected(method: str) -> bool:
    service = method.split("/")[1] if method.count("/") >= 2 else ""
    return service.startswith("kvmesh.") and service.rsplit(".", 1)[-1] == PROTECTED_SERVICE


@dataclass(frozen=True)
class Principal:
    """Who sent a request: its tenant and the cache namespace its hashes live in."""

    tenant: str = DEFAULT_TENANT
    namespace: str = ""  # "" = the default namespace


ANONYMOUS = Principal()
current_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar(
    "kvmesh_principal", default=ANONYMOUS
)


def tenant_seed(principal: Principal | None = None) -> bytes:
    """Bytes the request's namespace adds to its prefix-hash seed (see module doc)."""
    ns = (principal or current_principal.get()).namespace
    if not ns:
        return b""
    raw = ns.encode()
    return b"\xff" + len(raw).to_bytes(4, "big") + raw


class Unauthenticated(Exception):
    """Missing or wrong API key; the message says which (never echoes the key)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_entry(entry: str) -> tuple[str, Principal]:
    parts = entry.strip().split(":")
    key = parts[0]
    if not key or any(c.isspace() for c in key) or "," in key:
        raise ConfigError(
            f"api key entry {entry!r}: the key must be non-empty, without spaces, ',' or ':'"
        )
    if len(parts) == 1:
        return key, ANONYMOUS
    tenant = parts[1]
    if not tenant:
        raise ConfigError(f"api key entry for key {key[:4]}...: the tenant name is empty")
    if len(parts) == 2:
        return key, Principal(tenant, f"tenant {tenant}")
    if len(parts) == 3 and parts[2].startswith("shared=") and len(parts[2]) > 7:
        return key, Principal(tenant, f"shared {parts[2][7:]}")
    raise ConfigError(
        f"api key entry for key {key[:4]}...: write KEY, KEY:TENANT or KEY:TENANT:shared=NAMESPACE"
    )


class ApiKeys:
    """The conductor's key table (keys kept only as SHA-256 digests)."""

    def __init__(self, entries: Iterable[str] = ()) -> None:
        self._keys: dict[bytes, Principal] = {}
        for e in entries:
            if e.strip():
                key, p = parse_entry(e)
                self._keys[_digest(key)] = p

    @classmethod
    def from_config(cls, spec: str = "", path: str = "") -> ApiKeys:
        entries = [e for e in (spec or "").split(",") if e.strip()]
        if path:
            try:
                with open(path) as f:
                    for line in f:
                        line = line.split("#", 1)[0].strip()
                        if line:
                            entries.append(line)
            except OSError as e:
                raise ConfigError(f"api_keys_file: cannot read {path}: {e.strerror}") from None
            if not entries:
                raise ConfigError(f"api_keys_file: {path} holds no key")
        return cls(entries)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an ``authorization`` value (``Bearer KEY``); raises
        Unauthenticated. An open table (no keys) lets everyone in as the default tenant."""
        if not self._keys:
            return ANONYMOUS
        if not authorization:
            raise Unauthenticated("an API key is required: send 'authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("malformed authorization: expected 'Bearer <key>'")
        p = self._keys.get(_digest(key.strip()))
        if p is None:
            raise Unauthenticated("invalid API key")
        return p


def bearer_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying ``api_key`` (empty when no key)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Checks the API key of every call to the conductor's client service and runs the
    handler with the caller's :class:`Principal` in :data:`current_principal`."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not _protected(details.method):
            return handler
        auth = None
        for k, v in details.invocation_metadata or ():
            if k == "authorization":
                auth = v if isinstance(v, str) else None
                break
        try:
            principal = self.keys.authenticate(auth)
        except Unauthenticated as e:
            return _refusal(handler, str(e))
        return _with_principal(handler, principal)


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind that answers UNAUTHENTICATED without reading the
    request (its bytes are not even deserialized)."""

    @contextlib.asynccontextmanager
    async def refuse(ctx):
        await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    return wrap_handler(handler, refuse, request_deserializer=None)


def _with_principal(handler: grpc.RpcMethodHandler, principal: Principal) -> grpc.RpcMethodHandler:
    @contextlib.asynccontextmanager
    async def as_principal(ctx):
        current_principal.set(principal)  # one task per RPC: no reset needed
        yield

    return wrap_handler(handler, as_principal)


def api_key_from_env() -> str:
    """The client's API key from ``KVMESH_API_KEY`` (CLI default)."""
    return os.environ.get("KVMESH_API_KEY", "")


class _Undecodable:
    def __init__(self, error: DecodeError) -> None:
        self.error = error


class StrictDecoding(grpc.aio.ServerInterceptor):
    """The client API answers bytes that are not a valid request message (truncated
    frames, wrong wire types, non-UTF-8 strings) with INVALID_ARGUMENT instead of gRPC's
    UNKNOWN/INTERNAL and its logged stack trace."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (
            handler is None
            or not _protected(details.method)
            or handler.request_deserializer is None
        ):
            return handler
        deserialize = handler.request_deserializer
        method = details.method

        def safe(data: bytes):
            try:
                return deserialize(data)
            except DecodeError as e:  # truncated frames, wrong wire types, bad UTF-8
                return _Undecodable(e)

        async def check(request, ctx) -> None:
            if isinstance(request, _Undecodable):
                await ctx.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request is not a valid {method.rsplit('/', 1)[-1]} message "
                    f"({type(request.error).__name__}: {str(request.error)[:200]})",
                )

        return wrap_handler(handler, _nothing, request_deserializer=safe, check_request=check)


@contextlib.asynccontextmanager
async def _nothing(ctx):
    yield
