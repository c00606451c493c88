"""Certificates for the TLS tests, made with Debian's ``openssl`` command (no Python crypto library
needed): a CA, server certificates for 127.0.0.1 and localhost, a client certificate for mutual TLS,
an expired one, and a second CA whose certificates the first does not trust."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, env=env)


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


def make_ca(directory: Path, name: str = "ca") -> Pair:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    # The extensions Python 3.13's default contexts ask for (VERIFY_X509_STRICT): a CA's key usage.
    _openssl(
        "req", "-x509", *_EC, "-keyout", str(key), "-out", str(cert), "-days", "3", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-addext", "subjectKeyIdentifier=hash",
    )  # fmt: skip
    return Pair(str(cert), str(key))


def issue(
    directory: Path, ca: Pair, name: str, *, client: bool = False, expired: bool = False, cn: str = "localhost"
) -> Pair:
    """A certificate signed by ``ca`` (``expired``: valid for one day in 2020, signed under libfaketime)."""
    cert, key, csr = directory / f"{name}.pem", directory / f"{name}.key", directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    usage = "extendedKeyUsage=clientAuth\n" if client else "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
    # Python 3.13's strict verification also wants the issuer's key identifier on every certificate.
    ext.write_text(usage + "authorityKeyIdentifier=keyid,issuer\nsubjectKeyIdentifier=hash\n")
    _openssl("req", "-new", *_EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={cn}")
    env = None
    if expired:
        env = {**os.environ, "LD_PRELOAD": _libfaketime(), "FAKETIME": "@2020-01-01 00:00:00"}
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial",
        "-out", str(cert), "-days", "1", "-extfile", str(ext), env=env,
    )  # fmt: skip
    os.chmod(key, 0o600)
    return Pair(str(cert), str(key))


def _libfaketime() -> str:
    for path in (
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    ):
        if os.path.exists(path):
            return path
    raise RuntimeError("libfaketime not found (apt-get install faketime)")


@dataclass(frozen=True)
class Certs:
    directory: Path
    ca: Pair
    server: Pair
    server2: Pair  # another server certificate of the same CA (for the reload tests)
    client: Pair
    other_ca: Pair
    stranger: Pair  # a client certificate of the other CA


def make_certs(directory: Path) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory)
    other = make_ca(directory, "other-ca")
    return Certs(
        directory=directory,
        ca=ca,
        server=issue(directory, ca, "server"),
        server2=issue(directory, ca, "server2", cn="localhost-2"),
        client=issue(directory, ca, "client", client=True, cn="app-1"),
        other_ca=other,
        stranger=issue(directory, other, "stranger", client=True, cn="stranger"),
    )
