"""Config shared by every service (:class:`ServiceConfig`) and the data-plane secret rules.
A model node's options (:class:`~kvmesh.services.node_config.NodeConfig`) live beside the
model nodes, since checking them needs the engine."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass

from kvmesh.services.common.config import ConfigError, option

log = logging.getLogger(__name__)

DEV_SECRET = "kvmesh-dev-secret"
# secrets anyone can read in this repository: the default and the deploy files' old one
KNOWN_SECRETS = frozenset({DEV_SECRET, "change-me"})


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a port on this machine: a loopback address
    (127.0.0.0/8, ::1) or ``localhost``. Any other name counts as reachable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name
        return False


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` takes every address of the machine (0.0.0.0, ::, empty)."""
    return host.strip("[]") in ("0.0.0.0", "::", "")


def check_data_plane_secret(secret: str, host: str) -> None:
    """Refuses (ConfigError) a data-plane secret from :data:`KNOWN_SECRETS` on a node that
    binds and advertises ``host`` off loopback: whoever reaches its data port could read
    and write the node's KV memory. On loopback it only warns."""
    if secret not in KNOWN_SECRETS:
        return
    if not is_loopback(host):
        raise ConfigError(
            f"secret: the data-plane secret is the well-known {secret!r} and this node "
            f"binds {host}, which is not a loopback address: anyone who reaches its data "
            f"port could read and write its KV memory. Set KVMESH_SECRET (or --secret) to "
            f"a random value shared by every node of the cluster, e.g. `openssl rand -hex 32`"
        )
    log.warning(
        "data plane on %s with the well-known secret %r: fine on loopback only; set "
        "KVMESH_SECRET before binding another address",
        host,
        secret,
    )


@dataclass
class ServiceConfig:
    """Options every kvmesh service takes."""

    cluster: str = option("default", "cluster name; etcd keys live under /kvmesh/<cluster>/")
    etcd: str = option("127.0.0.1:2379", "etcd endpoints, comma-separated host:port")
    etcd_user: str = option("", "etcd user name (empty = no auth)")
    etcd_password: str = option("", "etcd password")
    etcd_ca: str = option(
        "",
        "CA certificate (PEM) to verify etcd's TLS certificate; setting any "
        "etcd_ca/etcd_cert makes the etcd connection TLS",
    )
    etcd_cert: str = option(
        "", "client certificate (PEM) presented to etcd (its --client-cert-auth)"
    )
    etcd_key: str = option("", "private key (PEM) of --etcd-cert")
    tls_cert: str = option(
        "",
        "certificate (PEM) of this service: its gRPC port speaks TLS, and it "
        "is presented as the client certificate to peers (empty = plaintext)",
    )
    tls_key: str = option("", "private key (PEM) of --tls-cert")
    tls_ca: str = option(
        "",
        "CA certificate (PEM): peers' certificates must be signed by it; with "
        "--tls-cert it turns on mutual TLS (clients must present a certificate)",
    )
    tls_server_name: str = option(
        "",
        "name to check in peers' server certificates instead of "
        "their address (empty = the address)",
    )
    host: str = option(
        "127.0.0.1",
        "address to bind (0.0.0.0 or :: = every address); advertised to peers too unless "
        "--advertise-host is set",
    )
    advertise_host: str = option(
        "",
        "address registered in etcd for peers and clients to reach this service's ports "
        "(empty = --host; give it with --host 0.0.0.0 or ::, which only this machine "
        "can dial)",
    )
    port: int = option(0, "gRPC port (0 = any free port)")
    node_id: str = option(
        "", "unique id of this process in the cluster (default: <role>-<host>-<pid>)"
    )
    lease_ttl: int = option(
        10, "etcd lease TTL in seconds; a dead node leaves the cluster within it"
    )
    grace_s: float = option(1.0, "seconds between deregistering and stopping on shutdown")
    log_level: str = option("INFO", "log level: DEBUG, INFO, WARNING, ERROR")
    metrics_port: int = option(
        0,
        "Prometheus /metrics HTTP port on --host (0 = any free port, "
        'advertised in etcd as "metrics"; -1 = off)',
    )

    def validate(self) -> None:
        if not self.cluster or "/" in self.cluster:
            raise ConfigError(f"cluster: {self.cluster!r} must be a non-empty name without '/'")
        if not self.etcd_endpoints:
            raise ConfigError("etcd: give at least one host:port")
        for ep in self.etcd_endpoints:
            if ":" not in ep:
                raise ConfigError(f"etcd: endpoint {ep!r} must be host:port")
        if is_wildcard(self.host) and not self.advertise_host:
            log.warning(
                "--host %s binds every address and, without --advertise-host, is what "
                "peers are told: only processes on this machine can dial it; give "
                "--advertise-host with the address others reach this machine at",
                self.host,
            )
        if self.advertise_host and is_wildcard(self.advertise_host):
            raise ConfigError(
                f"advertise_host: {self.advertise_host} is a wildcard; give an address "
                f"peers can dial"
            )
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port: {self.port} is not a TCP port (0-65535)")
        if not -1 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port: {self.metrics_port} is not a TCP port (or -1 = off)")
        if self.lease_ttl < 2:
            raise ConfigError(f"lease_ttl: {self.lease_ttl}s is too short; use 2 or more")
        if self.grace_s < 0:
            raise ConfigError("grace_s: must be >= 0")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level: {self.log_level!r} is not DEBUG, INFO, WARNING or ERROR")
        from kvmesh.services.common.channels import TlsFiles

        TlsFiles.from_config(self).validate("tls")
        if self.tls_ca and not self.tls_cert:
            raise ConfigError(
                "tls_ca: a service with a CA also needs --tls-cert/--tls-key "
                "(mutual TLS: it is a server and a client of its peers)"
            )
        TlsFiles(self.etcd_cert, self.etcd_key, self.etcd_ca).validate("etcd")

    @property
    def advertised_host(self) -> str:
        """The address peers are told: ``advertise_host``, else ``host``."""
        return self.advertise_host or self.host

    def advertise(self, address: str) -> str:
        """``address`` (``host:port``, as bound) with its host replaced by
        :attr:`advertised_host`."""
        if not address:
            return address
        return f"{self.advertised_host}:{address.rpartition(':')[2]}"

    @property
    def etcd_endpoints(self) -> list[str]:
        return [e.strip() for e in self.etcd.split(",") if e.strip()]

    def default_node_id(self, role: str) -> str:
        return self.node_id or f"{role}-{socket.gethostname()}-{os.getpid()}"


# torch threads a model node takes when nothing sets its ``threads``: a launcher's share of
# its machine's cores (``kvmesh.services.launcher.cluster``), read by the model nodes
THREAD_SHARE_ENV = "KVMESH_LAUNCHER_THREAD_SHARE"

# --te-max-conns of every service with a data port (model nodes, store nodes)
TE_MAX_CONNS_HELP = (
    "most connections the transfer engine's data port holds at once, peers being "
    "served and handshakes in progress together (each peer opens a few); at the "
    "limit a new connection closes the oldest unfinished handshake, or is closed "
    'itself when all are peers (kvmesh_data_port_refused_total{reason="limit"}); '
    "a handshake not finished in 3 s is closed"
)
