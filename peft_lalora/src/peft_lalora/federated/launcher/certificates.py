"""TLS certificates for a local SuperLink: a throw-away self-signed CA and a server certificate.

:func:`generate_tls` writes ``ca.pem`` (the root certificate every client trusts), ``server.pem`` and
``server.key`` (the SuperLink's certificate, signed by that CA, and its private key, mode ``0600``), in a
``0700`` folder. The
CA's private key is never written: it signs the one server certificate in memory and is then dropped,
so nothing on disk can issue another certificate that the clients would trust. Users with their own PKI
pass a :class:`TLSConfig` with their paths instead.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .workdir import private_dir

__all__ = ["DEFAULT_HOSTS", "TLSConfig", "generate_tls", "write_private"]

DEFAULT_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class TLSConfig:
    """Paths of the PEM files a TLS SuperLink needs (``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile``);
    clients (SuperNodes, ``flwr``) get ``ca_cert`` as their root certificate."""

    ca_cert: Path
    server_cert: Path
    server_key: Path

    def __post_init__(self) -> None:
        for name in ("ca_cert", "server_cert", "server_key"):
            object.__setattr__(self, name, Path(getattr(self, name)).expanduser().resolve())

    def missing(self) -> list[Path]:
        """The files of this configuration that do not exist."""
        return [p for p in (self.ca_cert, self.server_cert, self.server_key) if not p.is_file()]


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner only (``0600`` from creation on)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the file may have existed with wider permissions
        os.write(fd, data)
    finally:
        os.close(fd)


def _san(hosts: Sequence[str]) -> list[object]:
    from cryptography import x509

    names: list[object] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def generate_tls(directory: str | Path, hosts: Sequence[str] = DEFAULT_HOSTS, *, valid_days: int = 30) -> TLSConfig:
    """Create a CA and a server certificate for ``hosts`` (IPs and DNS names, all as SANs) in
    ``directory``; return their paths. Keys are ECDSA P-384; the server key is written with mode 0600."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise ValueError("at least one host is needed for the server certificate")
    d = private_dir(directory)
    now = dt.datetime.now(dt.timezone.utc)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=valid_days)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "peft-lalora local federation CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(_san(hosts)), critical=False)  # type: ignore[arg-type]
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    tls = TLSConfig(d / "ca.pem", d / "server.pem", d / "server.key")
    tls.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    tls.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    write_private(
        tls.server_key,
        server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )
    return tls
