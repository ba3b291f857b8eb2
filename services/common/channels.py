"""Every gRPC channel and server port of kvmesh goes through here, so TLS is one switch.

TLS is configured per process from files (``--tls-cert``, ``--tls-key``, ``--tls-ca``,
on every service in ``ServiceConfig``):

  * no files: plaintext (a dev cluster on loopback);
  * ``--tls-cert`` + ``--tls-key``: servers speak TLS with that certificate; clients
    verify servers against ``--tls-ca`` (or the system roots when it is empty);
  * ``--tls-ca`` as well: **mutual TLS** -- servers require a client certificate signed by
    that CA, and clients present their own certificate (the same cert/key pair: every
    kvmesh process is both a server and a client of its peers).

``configure(cfg)`` (called once by ``Service``) sets the process-wide TLS settings;
``make_channel(addr)`` and ``add_server_port(server, addr)`` then use them, so code deep
inside the store or the conductor needs no config plumbing. Both also take an explicit
``tls`` (a :class:`TlsFiles`) for clients such as ``kvmesh generate``.

Tracing survives TLS: plaintext channels go through ``grpc.aio.insecure_channel`` (which
``kvmesh.services.common.telemetry`` patches); secure ones get ``telemetry.client_interceptors()``
here. ``--tls-server-name`` overrides the name checked against the server's certificate
(for clusters whose certificates do not list every advertised address).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvmesh.services.common.config import ConfigError


@dataclass(frozen=True)
class TlsFiles:
    """Paths of a TLS identity; empty strings mean "not set"."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    server_name: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    @property
    def mutual(self) -> bool:
        return bool(self.ca and self.cert)

    @classmethod
    def from_config(cls, cfg: Any) -> TlsFiles:
        return cls(
            getattr(cfg, "tls_cert", "") or "",
            getattr(cfg, "tls_key", "") or "",
            getattr(cfg, "tls_ca", "") or "",
            getattr(cfg, "tls_server_name", "") or "",
        )

    def validate(self, what: str = "tls") -> None:
        """Raises ConfigError with a clear message when the files do not fit together."""
        if bool(self.cert) != bool(self.key):
            raise ConfigError(
                f"{what}: give both a certificate and a key (--tls-cert and --tls-key), or neither"
            )
        for name, path in (("cert", self.cert), ("key", self.key), ("ca", self.ca)):
            if path and not os.path.isfile(path):
                raise ConfigError(f"{what}_{name}: {path!r} is not a readable file")


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


_current = TlsFiles()


def configure(cfg: Any) -> TlsFiles:
    """Sets this process's TLS settings from a config with ``tls_*`` fields."""
    global _current
    _current = cfg if isinstance(cfg, TlsFiles) else TlsFiles.from_config(cfg)
    _current.validate()
    return _current


def current() -> TlsFiles:
    return _current


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """Client credentials: verify the server against ``tls.ca`` (system roots when
    empty) and present our certificate when we have one (mutual TLS)."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca),
        private_key=_read(tls.key),
        certificate_chain=_read(tls.cert),
    )


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials; with a CA the server requires a client certificate (mTLS)."""
    if not (tls.cert and tls.key):
        raise ConfigError("a TLS server needs --tls-cert and --tls-key")
    ca = _read(tls.ca)
    return grpc.ssl_server_credentials(
        [(_read(tls.key), _read(tls.cert))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def make_channel(
    addr: str,
    tls: TlsFiles | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
    interceptors: Sequence[Any] | None = None,
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``addr``: plaintext when TLS is off, else TLS (mutual
    when we hold a certificate). Tracing interceptors are kept either way."""
    tls = _current if tls is None else tls
    opts = list(options or [])
    if not tls.enabled:
        return grpc.aio.insecure_channel(
            addr, options=opts or None, interceptors=list(interceptors or []) or None
        )
    from kvmesh.services.common import telemetry

    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(
        addr,
        channel_credentials(tls),
        options=opts or None,
        interceptors=[*telemetry.client_interceptors(), *(interceptors or [])] or None,
    )


def make_sync_channel(addr: str, tls: TlsFiles | None = None) -> grpc.Channel:
    """A blocking channel (tests and small tools), same rules as :func:`make_channel`."""
    tls = _current if tls is None else tls
    if not tls.enabled:
        return grpc.insecure_channel(addr)
    opts = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else None
    return grpc.secure_channel(addr, channel_credentials(tls), options=opts)


def add_server_port(server: Any, addr: str, tls: TlsFiles | None = None) -> int:
    """Binds ``addr`` on ``server`` (TLS when a certificate is configured); returns the
    port (0 when binding failed, as grpc does)."""
    tls = _current if tls is None else tls
    if tls.cert:
        return server.add_secure_port(addr, server_credentials(tls))
    return server.add_insecure_port(addr)
