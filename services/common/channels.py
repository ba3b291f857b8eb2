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

import asyncio
import errno
import os
import socket
import ssl
from collections.abc import Mapping, Sequence
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
    def from_env(cls, env: Mapping[str, str] | None = None) -> TlsFiles:
        """What the services read from ``KVMESH_TLS_CERT``, ``KVMESH_TLS_KEY``,
        ``KVMESH_TLS_CA`` and ``KVMESH_TLS_SERVER_NAME`` (the CLIs' defaults, so a
        health check beside a service speaks to it as its peers do)."""
        env = os.environ if env is None else env
        return cls(*(env.get(f"KVMESH_TLS_{n}", "") for n in ("CERT", "KEY", "CA", "SERVER_NAME")))

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


def ssl_server_context(tls: TlsFiles | None = None) -> ssl.SSLContext | None:
    """The :mod:`ssl` twin of :func:`server_credentials`, for kvmesh's raw-TCP paths
    (the store's control path): the same certificate, and with a CA a client
    certificate signed by it is required (mutual TLS). None when this process serves
    plaintext gRPC (no certificate). TLS 1.2 at least."""
    tls = _current if tls is None else tls
    if not tls.cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert, tls.key)
    if tls.ca:
        ctx.load_verify_locations(tls.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def ssl_client_context(tls: TlsFiles | None = None) -> ssl.SSLContext | None:
    """The :mod:`ssl` twin of :func:`channel_credentials`: verify the server (name and
    chain) against ``tls.ca`` (system roots when empty) and present our certificate
    when we have one. None when TLS is off, as :func:`make_channel` goes plaintext."""
    tls = _current if tls is None else tls
    if not tls.enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.ca:
        ctx.load_verify_locations(tls.ca)
    else:
        ctx.load_default_certs()
    if tls.cert:
        ctx.load_cert_chain(tls.cert, tls.key)
    return ctx


async def ssl_handshake(sock: ssl.SSLSocket, timeout: float) -> None:
    """Completes the TLS handshake of a non-blocking ``sock`` (wrapped with
    ``do_handshake_on_connect=False``) on the running loop, within ``timeout``;
    raises :class:`ssl.SSLError` (a refused certificate, say) or ``TimeoutError``."""
    loop = asyncio.get_running_loop()
    fd = sock.fileno()
    async with asyncio.timeout(timeout):
        while True:
            try:
                sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                add, remove = loop.add_reader, loop.remove_reader
            except ssl.SSLWantWriteError:
                add, remove = loop.add_writer, loop.remove_writer
            ready = loop.create_future()
            add(fd, _wake, ready)
            try:
                await ready
            finally:
                remove(fd)


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


# Options of every gRPC server of kvmesh (:func:`make_server`). grpc sets SO_REUSEPORT on
# its listening sockets by default: a second server on a port in use (a second cluster,
# a node started twice) would bind it too, and the kernel would then split new clients
# between two unrelated servers. With it off, binding a used port fails (PortInUse).
SERVER_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)


class PortInUse(RuntimeError):
    """A service cannot listen on a port (another process holds it, or the address is
    not this machine's); the message names the address and says what to do."""


def make_server(interceptors: Sequence[Any] | None = None) -> grpc.aio.Server:
    """A ``grpc.aio`` server with :data:`SERVER_OPTIONS` (the only way kvmesh makes one)."""
    return grpc.aio.server(options=list(SERVER_OPTIONS), interceptors=interceptors)


def check_port(addr: str, what: str = "gRPC", option: str = "--port") -> None:
    """Raises :class:`PortInUse`, saying why, when a listening socket cannot be bound on
    ``addr`` now (a port in use, an address not this machine's); a check before a start
    that would only fail later (``kvmesh up``), and the diagnosis of a failed bind."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
            s.bind((host, int(port)))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            why = (
                "the port is already in use (another kvmesh cluster or service?); "
                f"stop the process that holds it or choose another {option}"
            )
        else:
            why = f"{e.strerror or e}"
        raise PortInUse(f"cannot listen for {what} on {addr}: {why}") from None
    except ValueError:
        raise PortInUse(f"cannot listen for {what} on {addr}: not a host:port address") from None


def bind_error(addr: str, what: str = "gRPC", option: str = "--port") -> PortInUse:
    """The :class:`PortInUse` for a bind of ``addr`` that failed, saying why (grpc only
    says that it failed)."""
    try:
        check_port(addr, what, option)
    except PortInUse as e:
        return e
    return PortInUse(f"cannot listen for {what} on {addr}: it could not be bound")


def add_server_port(server: Any, addr: str, tls: TlsFiles | None = None) -> int:
    """Binds ``addr`` on ``server`` (TLS when a certificate is configured) and returns
    the port; raises :class:`PortInUse`, naming ``addr``, when it cannot be bound (a
    server from :func:`make_server` refuses a port that another socket holds)."""
    tls = _current if tls is None else tls
    try:
        if tls.cert:
            port = server.add_secure_port(addr, server_credentials(tls))
        else:
            port = server.add_insecure_port(addr)
    except RuntimeError:  # grpc >= 1.5x raises "Failed to bind to address ..."
        port = 0
    if port == 0:  # older grpc returns 0
        raise bind_error(addr)
    return port


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
