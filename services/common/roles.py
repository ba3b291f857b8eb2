"""Roles of mutual-TLS identities and the one table of which role may call which RPC.

**Where a role lives.** Under mutual TLS every certificate names the role of whoever
holds it as a URI in its subject alternative names::

    kvmesh://role/<role>     <role>: conductor, store-master, prefill, decode,
                             store-node or client

(:func:`role_uri`; ``kvmesh up --tls`` and :class:`~kvmesh.services.common.pki.DevCA`
write it). A certificate may carry several role URIs (one certificate shared by every
service of a small deployment, say): it may call what any of them may. A certificate
**without** a role URI is treated as ``client`` -- it may call the conductor's public
API and nothing internal -- and a refusal says so. A role URI naming no known role grants
nothing.

**What each role may call.** :data:`RPC_ROLES` maps every RPC of ``protos/kvmesh.proto``
to the roles allowed to call it, following the actual call graph: clients call the
conductor's public API only; the nodes' internal RPCs accept the conductor and the peers
that call them (the store-master calls the segments' ``StoreSegment``, model nodes and
store nodes call the store-master, ...). The health service and server reflection answer
every certificate of the cluster's CA. ``docs/operations.md`` shows this table
(:func:`matrix_markdown`, checked by a test so the two cannot drift).

**Enforcement.** :class:`RoleInterceptor`, on every kvmesh gRPC server whose process runs
mutual TLS (:class:`~kvmesh.services.common.service.Service`), reads the caller's
certificate from the call's auth context and answers a call its roles may not make with
PERMISSION_DENIED naming the role and the RPC. An RPC missing from the table is refused
too (default deny). The store-master's raw-TCP fast path applies the same table to the
certificate of each connection (``FAST_RPCS`` in
``services/store_master/fastpath.py``). Without mutual TLS there is no
certificate and so no role: a plaintext or server-only-TLS cluster's internal ports are
as open as its network.

``python -m kvmesh.services.common.roles`` prints the table in Markdown.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Mapping

import grpc
from prometheus_client import Counter

from kvmesh.services.common.interceptors import wrap_handler
from kvmesh.services.common.metrics import REGISTRY

log = logging.getLogger(__name__)

DENIED = Counter(
    "kvmesh_rpc_denied_total",
    "gRPC calls refused (PERMISSION_DENIED) because the caller's certificate role may not "
    "make them, by RPC and role ('none': the certificate names no role)",
    ["method", "role"],
    registry=REGISTRY,
)

CONDUCTOR = "conductor"
STORE_MASTER = "store-master"
PREFILL = "prefill"
DECODE = "decode"
STORE_NODE = "store-node"
CLIENT = "client"
ROLES = (CONDUCTOR, STORE_MASTER, PREFILL, DECODE, STORE_NODE, CLIENT)
SERVICE_ROLES = ROLES[:-1]  # the kvmesh processes (every role but client)

ROLE_URI_PREFIX = "kvmesh://role/"

_MODEL_NODES = frozenset({PREFILL, DECODE})  # store clients (StoreClient)
_LENDERS = _MODEL_NODES | {STORE_NODE}  # segment hosts (SegmentHost)


def _service(name: str, methods: Mapping[str, Iterable[str]]) -> dict[str, frozenset[str]]:
    return {f"/kvmesh.v1.{name}/{m}": frozenset(r) for m, r in methods.items()}


# Every RPC of protos/kvmesh.proto -> the roles that may call it (who calls it, in brackets).
RPC_ROLES: dict[str, frozenset[str]] = {
    # the public API [kvmesh generate/status, OpenAI-face clients of gRPC, load tools]
    **_service("Conductor", {"Generate": {CLIENT}, "ClusterStatus": {CLIENT}}),
    **_service(
        "StoreMaster",
        {
            # segment hosts mount, re-report and leave their segments [SegmentHost,
            # StoreClient.close]
            "MountSegment": _LENDERS,
            "UnmountSegment": _LENDERS,
            "ReportBlocks": _LENDERS,
            "StoreHello": _LENDERS,
            # block events: segment hosts and the conductor's cache index
            "WatchBlocks": _LENDERS | {CONDUCTOR},
            # the store's data calls [StoreClient in model nodes]
            "PutStart": _MODEL_NODES,
            "PutEnd": _MODEL_NODES,
            "PutLocal": _MODEL_NODES,
            "GetReplicas": _MODEL_NODES,
            "Remove": _MODEL_NODES,
            "Pin": _MODEL_NODES,
            "Unpin": _MODEL_NODES,
            # prefix look-ups [StoreClient; the conductor's routing]
            "Exists": _MODEL_NODES | {CONDUCTOR},
            # capacity [StoreClient, store tools with a store node's identity; the
            # conductor's status]
            "Stats": _LENDERS | {CONDUCTOR},
        },
    ),
    # the store-master's hands on a segment's data [store-master]
    **_service("StoreSegment", {m: {STORE_MASTER} for m in ("Spill", "Promote", "Replicate")}),
    # the nodes' internal API [conductor]
    **_service("PrefillNode", {m: {CONDUCTOR} for m in ("Prefill", "Status", "WatchEvents")}),
    **_service(
        "DecodeNode",
        {m: {CONDUCTOR} for m in ("Reserve", "Decode", "Release", "Status", "WatchEvents")},
    ),
}

# Services every certificate of the cluster's CA may call (whole services, any method).
OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)


def role_uri(role: str) -> str:
    """The SAN URI naming ``role`` (raises ValueError for an unknown role)."""
    if role not in ROLES:
        raise ValueError(f"unknown kvmesh role {role!r}: one of {', '.join(ROLES)}")
    return ROLE_URI_PREFIX + role


def role_of_name(name: str) -> str | None:
    """The role a launcher's process name starts with (``store-master-0``, ``decode-1``,
    ``client``), None for any other (``etcd``)."""
    for role in sorted(ROLES, key=len, reverse=True):
        if name == role or name.startswith(role + "-"):
            return role
    return None


def roles_from_uris(uris: Iterable[str]) -> frozenset[str]:
    """The roles named by ``kvmesh://role/...`` URIs among ``uris`` (other URIs ignored);
    an unknown role name is kept, and grants nothing."""
    return frozenset(u[len(ROLE_URI_PREFIX) :] for u in uris if u.startswith(ROLE_URI_PREFIX))


def roles_of_peercert(peercert: Mapping | None) -> frozenset[str]:
    """The roles of an :meth:`ssl.SSLSocket.getpeercert` dict (the fast path's peers)."""
    sans = (peercert or {}).get("subjectAltName", ())
    return roles_from_uris(v for k, v in sans if k == "URI")


def roles_of_cert_file(path: str) -> frozenset[str]:
    """The roles a PEM certificate file names (its first certificate's SAN URIs)."""
    from cryptography import x509

    with open(path, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return frozenset()
    return roles_from_uris(san.get_values_for_type(x509.UniformResourceIdentifier))


def check_own_role(cert_path: str, role: str) -> str:
    """A warning (or "") for a service whose own certificate does not name its ``role``:
    under mutual TLS its peers will refuse its internal calls."""
    if role not in SERVICE_ROLES:
        return ""
    try:
        mine = roles_of_cert_file(cert_path)
    except (OSError, ValueError) as e:
        return f"cannot read the roles of {cert_path}: {e}"
    if role in mine:
        return ""
    named = ", ".join(sorted(mine)) or "no role (a client's)"
    return (
        f"this {role}'s certificate {cert_path} names {named}, not {role_uri(role)}: "
        "its peers will refuse its internal calls (PERMISSION_DENIED); issue it with that "
        "URI in its subject alternative names (docs/operations.md, Roles)"
    )


def effective(roles: frozenset[str]) -> frozenset[str]:
    """A certificate without a role is a client's (see the module doc)."""
    return roles or frozenset({CLIENT})


def may_call(method: str, roles: frozenset[str]) -> bool:
    """Whether a caller holding ``roles`` (as :func:`effective` reads them) may call the
    full gRPC ``method`` (``/package.Service/Method``)."""
    if _open(method):
        return True
    return bool(RPC_ROLES.get(method, frozenset()) & effective(roles))


def _open(method: str) -> bool:
    """Whether ``method`` belongs to one of :data:`OPEN_SERVICES`."""
    return method.count("/") >= 2 and method.split("/")[1] in OPEN_SERVICES


def describe(roles: frozenset[str]) -> str:
    """The caller, as a refusal names it."""
    if not roles:
        return f"role '{CLIENT}' (the certificate names no role: kvmesh://role/<role>)"
    return "role " + " + ".join(f"'{r}'" for r in sorted(roles))


def refusal_message(method: str, roles: frozenset[str]) -> str:
    allowed = RPC_ROLES.get(method)
    who = "no role" if not allowed else ", ".join(r for r in ROLES if r in allowed)
    return f"{describe(roles)} may not call {method} (allowed: {who})"


@functools.lru_cache(maxsize=256)
def _roles_of_uris(uris: tuple[bytes, ...]) -> frozenset[str]:
    return roles_from_uris(u.decode(errors="replace") for u in uris)


def peer_roles(context: grpc.aio.ServicerContext) -> frozenset[str] | None:
    """The roles of the caller's certificate (gRPC's auth context lists its SAN URIs as
    ``peer_uri``); None when the call carries no certificate (plaintext, or TLS without
    client certificates)."""
    auth = context.auth_context() or {}
    if "x509_pem_cert" not in auth:
        return None
    return _roles_of_uris(tuple(auth.get("peer_uri", ())))


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with PERMISSION_DENIED, every call whose caller's certificate roles
    :data:`RPC_ROLES` does not allow (installed on servers of processes with mutual TLS:
    every call then carries a certificate)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        if _open(method):
            return handler

        @contextlib.asynccontextmanager
        async def check(ctx):
            roles = peer_roles(ctx)
            if roles is not None and not may_call(method, roles):
                await ctx.abort(grpc.StatusCode.PERMISSION_DENIED, _denied(method, roles))
            yield

        return wrap_handler(handler, check)


_logged: set[tuple[str, frozenset[str]]] = set()


def _denied(method: str, roles: frozenset[str]) -> str:
    """Counts a refusal, logs the first of each (RPC, roles) pair, returns its message."""
    message = refusal_message(method, roles)
    DENIED.labels(method, "+".join(sorted(roles)) or "none").inc()
    if (method, roles) not in _logged and len(_logged) < 1024:
        _logged.add((method, roles))
        log.warning("refused a call (further ones are only counted): %s", message)
    return message


def matrix_markdown() -> str:
    """The role x RPC table of ``docs/operations.md`` (from :data:`RPC_ROLES`)."""
    head = ["RPC", *ROLES]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for method, allowed in RPC_ROLES.items():
        _, service, name = method.split("/")
        row = [f"`{service.rsplit('.', 1)[-1]}.{name}`"]
        row += ["yes" if r in allowed else "" for r in ROLES]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(matrix_markdown(), end="")
