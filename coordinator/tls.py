"""TLS certificates for a test or pilot federation (``cryptography``); the node-authentication keys are
``feta_release.signing.make_node_auth_key`` (a site kit makes its own).

A production site uses its organisation's PKI; these are for loopback tests and pilots:
  ca.crt / ca.key            a self-signed CA
  server.pem / server.key    the SuperLink's certificate (SANs: the given hosts/IPs), signed by the CA
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from feta_release.errors import ConfigError
from feta_release.signing import write_new_key


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def make_certificates(
    out_dir: str | Path, hosts: Iterable[str] = ("127.0.0.1", "localhost"), days: int = 30
) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "ca_cert": out / "ca.crt",
        "ca_key": out / "ca.key",
        "server_cert": out / "server.pem",
        "server_key": out / "server.key",
    }
    if there := [str(p) for p in paths.values() if p.exists() or p.is_symlink()]:
        raise ConfigError(
            f"{', '.join(there)}: already exist(s); refusing to overwrite certificates or keys "
            "(choose another --out)"
        )
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "feta-release test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    srv_key = ec.generate_private_key(ec.SECP384R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    srv = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, next(iter(hosts), "localhost"))]))
        .issuer_name(ca_name)
        .public_key(srv_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    paths["ca_cert"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    write_new_key(paths["ca_key"], _pem_key(ca_key))
    paths["server_cert"].write_bytes(srv.public_bytes(serialization.Encoding.PEM))
    write_new_key(paths["server_key"], _pem_key(srv_key))
    return paths
