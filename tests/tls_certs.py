"""A throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1 / localhost,
and a client certificate (mTLS), written as PEM files by the ``cryptography`` package."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, issuer_key: ec.EllipticCurvePrivateKey,
           *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
         .not_valid_after(now + dt.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        b = b.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        b = b.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    if server:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.DNSName(subject), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        ), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_pki(folder: Path, server_name: str = "temporal.test") -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("milestone test CA", ca_key, _name("milestone test CA"), ca_key, ca=True)
    out = Pki(folder / "ca.pem", folder / "server.pem", folder / "server.key", folder / "client.pem", folder / "client.key")
    out.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for cert_path, key_path, cn, server in ((out.server_cert, out.server_key, server_name, True),
                                            (out.client_cert, out.client_key, "milestone worker", False)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert_path.write_bytes(_issue(cn, key, ca.subject, ca_key, server=server).public_bytes(serialization.Encoding.PEM))
        _write_key(key, key_path)
    return out
