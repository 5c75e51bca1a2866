"""X.509 certificates (a CA and a server certificate for TLS) and SuperNode key pairs for Flower
deployments. Private keys are created with mode 0600 (never readable by others, not even for a
moment), and no file is overwritten: a folder that is a file, or that already holds one of the
files, stops with one line before anything is written."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from fedtune.errors import FedtuneError


class CertificateError(FedtuneError):
    """Where the keys were to go cannot take them (one line naming the path)."""


def _claim(folder: Path, names: Sequence[str]) -> list[Path]:
    """``folder / name`` for each name, once ``folder`` is a folder (created) holding none of them."""
    if folder.exists() and not folder.is_dir():
        raise CertificateError(f"{folder}: not a folder (give a folder for the keys)")
    paths = [folder / name for name in names]
    taken = [str(p) for p in paths if p.exists() or p.is_symlink()]
    if taken:
        raise CertificateError(f"{taken[0]} exists: keys are never overwritten (remove it or give another folder)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CertificateError(f"{folder}: cannot create the folder ({exc.strerror})") from None
    return paths


def _write_new(path: Path, data: bytes, private: bool = False) -> None:
    """A new file (O_EXCL: never an existing one or a link), mode 0600 from its creation if ``private``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    except OSError as exc:
        raise CertificateError(f"{path}: cannot create it ({exc.strerror})") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def generate_certificates(
    folder: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"), days: int = 30
) -> dict[str, Path]:
    """A self-signed CA and a server certificate for ``hosts`` (IP addresses or DNS names), as
    PEM files in ``folder``: ``ca.crt`` (give it to SuperNodes and ``flwr``), ``server.pem`` and
    ``server.key`` (the SuperLink's). For tests and trials; use your own PKI in production."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_path, cert_path, key_path = _claim(Path(folder), ("ca.crt", "server.pem", "server.key"))
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedtune test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
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
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(hosts[0]))]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write_new(ca_path, ca.public_bytes(serialization.Encoding.PEM))
    _write_new(cert_path, server.public_bytes(serialization.Encoding.PEM))
    pkcs8 = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write_new(key_path, pkcs8, private=True)
    return {"ca": ca_path, "cert": cert_path, "key": key_path}


def generate_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's authentication key pair (EC P-384, OpenSSH format, as Flower expects):
    ``<name>`` (private, ``flower-supernode --auth-supernode-private-key``) and ``<name>.pub``
    (``flwr supernode register``)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not name or "/" in name or name in (".", ".."):
        raise CertificateError(f"--name {name!r}: expected a file name")
    private, public = _claim(Path(folder), (name, f"{name}.pub"))
    key = ec.generate_private_key(ec.SECP384R1())
    openssh = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    _write_new(private, openssh, private=True)
    _write_new(
        public, key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    return private, public
