"""A throwaway PKI for dev clusters and tests (``kvmesh up --tls``): one CA and one
certificate per service, each valid as TLS server *and* client (kvmesh processes are
both), with SANs for loopback (``127.0.0.1``, ``::1``, ``localhost``) plus any given,
and the holder's role(s) as ``kvmesh://role/<role>`` URIs
(:mod:`kvmesh.services.common.roles`: what each role may call).

Needs the ``cryptography`` package. Never use these for a production cluster: the CA key
sits next to the certificates, unencrypted.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvmesh.services.common.roles import CLIENT, role_uri

DEFAULT_SANS = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class Identity:
    cert: str
    key: str
    ca: str


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: str) -> None:
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(cert, path: str) -> None:
    from cryptography.hazmat.primitives import serialization

    with open(path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))


def _sans(names: Iterable[str], roles: Iterable[str] = ()):
    from cryptography import x509

    out: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(role_uri(r)) for r in dict.fromkeys(roles)
    ]
    for n in dict.fromkeys(names):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return out


class DevCA:
    """A CA that issues service certificates into ``directory``."""

    def __init__(self, directory: str, name: str = "kvmesh dev CA", days: int = 30) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import NameOID

        os.makedirs(directory, exist_ok=True)
        self.dir, self.days = directory, days
        self.key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.ca_path = os.path.join(directory, "ca.pem")
        _write_cert(self.cert, self.ca_path)
        _write_key(self.key, os.path.join(directory, "ca-key.pem"))

    def issue(
        self, name: str, sans: Iterable[str] = DEFAULT_SANS, roles: Iterable[str] = ()
    ) -> Identity:
        """Writes ``<name>.pem`` and ``<name>-key.pem``; the common name is ``name``, and
        the certificate names ``roles`` (none: treated as a client; an unknown role
        raises ValueError)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = _key()
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=self.days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(_sans(sans, roles)), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        cert_path = os.path.join(self.dir, f"{name}.pem")
        key_path = os.path.join(self.dir, f"{name}-key.pem")
        _write_cert(cert, cert_path)
        _write_key(key, key_path)
        return Identity(cert_path, key_path, self.ca_path)


def generate_dev_pki(
    directory: str, names: Mapping[str, Iterable[str]], sans: Iterable[str] = DEFAULT_SANS
) -> dict[str, Identity]:
    """A fresh CA in ``directory`` and one identity per name, with its roles (plus
    ``client``, role client, for CLIs)."""
    ca = DevCA(directory)
    out = {n: ca.issue(n, sans, roles) for n, roles in names.items()}
    out.setdefault("client", ca.issue("client", sans, [CLIENT]))
    return out
