"""``stats settings`` shows the TLS and authentication settings under memcached 1.6's names and in its
formats (issue 27): a real client (pymemcache, over TLS, logged in) asks the daemon and, in the same
test, Debian's ``memcached -Z -Y`` started with the same files; the binary protocol's STAT
``settings`` after a SASL PLAIN login shows the same fields."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DaemonFactory, free_port, wait_for_port
from pymemcache.client.base import Client
from tls_certs import Certs, make_certs

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

#: The names memcached 1.6 shows that we show too, with the same meaning (its ssl_wbuf_size,
#: ssl_session_cache and ssl_kernel_tls have no counterpart here).
SHARED = [
    "auth_enabled_sasl",
    "auth_enabled_ascii",
    "ssl_enabled",
    "ssl_chain_cert",
    "ssl_key",
    "ssl_verify_mode",
    "ssl_keyformat",
    "ssl_ciphers",
    "ssl_ca_cert",
    "ssl_min_version",
]
USER, PASSWORD = "alice", "secret1"


@pytest.fixture(scope="module")
def files() -> Iterator[tuple[Certs, Path]]:
    """Certificates and an auth file that memcached (as root or as 'nobody') can read too."""
    directory = Path(tempfile.mkdtemp(prefix="kp-settings-"))
    directory.chmod(0o755)
    try:
        certs = make_certs(directory)
        (directory / "users").write_text(f"{USER}:{PASSWORD}\n")
        (directory / "users").chmod(0o644)
        yield certs, directory / "users"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def start_memcached(*args: str) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("memcached")
    if binary is None:
        pytest.skip("memcached is not installed (apt-get install memcached)")
    port = free_port()
    cmd = [binary, "-l", "127.0.0.1", "-p", str(port), "-U", "0", "-t", "1", "-m", "16", *args]
    if os.geteuid() == 0:
        cmd += ["-u", "root"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port, proc)  # type: ignore[arg-type]
    return proc, port


def settings(port: int, context: ssl.SSLContext | None, login: bool) -> dict[str, str]:
    """``stats settings`` as pymemcache reads it (logged in first with a ``set`` when ``login``)."""
    client = Client(("127.0.0.1", port), tls_context=context, connect_timeout=5, timeout=5)
    try:
        if login:
            assert client.set("auth", f"{USER} {PASSWORD}", noreply=False)
        found = client.stats("settings")
    finally:
        client.close()

    # pymemcache reads yes/no fields (auth_enabled_sasl) as booleans: back to the wire's words.
    def word(value: object) -> str:
        if isinstance(value, bytes):
            return value.decode()
        return ("yes" if value else "no") if isinstance(value, bool) else str(value)

    return {k.decode(): word(v) for k, v in found.items()}


def test_tls_and_auth_settings_as_memcached_shows_them(daemons: DaemonFactory, files: tuple[Certs, Path]) -> None:
    certs, users = files
    tls = ["--tls-cert", certs.server.cert, "--tls-key", certs.server.key, "--tls-ca", certs.ca.cert]
    ours = daemons.start(
        *tls, "--tls-verify", "request", "--tls-min-version", "1.3", "--tls-ciphers", "HIGH", "--auth-file", str(users)
    )
    options = [
        f"ssl_chain_cert={certs.server.cert}",
        f"ssl_key={certs.server.key}",
        f"ssl_ca_cert={certs.ca.cert}",
        "ssl_verify_mode=1",
        "ssl_min_version=3",  # memcached 1.6.18 takes the number (0-3), shows tlsv1.3
        "ssl_ciphers=HIGH",
    ]
    proc, port = start_memcached("-Z", "-o", ",".join(options), "-Y", str(users))
    try:
        context = ssl.create_default_context(cafile=certs.ca.cert)
        context.load_cert_chain(certs.client.cert, certs.client.key)
        mine, theirs = settings(ours.port, context, True), settings(port, context, True)  # type: ignore[arg-type]
    finally:
        proc.kill()
        proc.wait()
    assert set(SHARED) <= set(theirs), "memcached's names"
    expected = {
        "auth_enabled_sasl": "yes",  # --auth-file serves SASL PLAIN too; memcached needs -S for it
        "auth_enabled_ascii": str(users),
        "ssl_enabled": "yes",
        "ssl_chain_cert": certs.server.cert,
        "ssl_key": certs.server.key,
        "ssl_verify_mode": "1",
        "ssl_keyformat": "1",
        "ssl_ciphers": "HIGH",
        "ssl_ca_cert": certs.ca.cert,
        "ssl_min_version": "tlsv1.3",
    }
    assert {name: mine.get(name) for name in SHARED} == expected
    assert {name: theirs[name] for name in SHARED} == {**expected, "auth_enabled_sasl": "no"}
    assert (mine["auth_token_file"], mine["login_timeout"], mine["plain_port"]) == ("NULL", "10", "0")


def test_with_tls_and_auth_off_the_fields_read_as_memcached_shows_them_off(daemons: DaemonFactory) -> None:
    ours = daemons.start()
    proc, port = start_memcached()
    try:
        mine, theirs = settings(ours.port, None, False), settings(port, None, False)  # type: ignore[arg-type]
    finally:
        proc.kill()
        proc.wait()
    assert {name: mine.get(name) for name in SHARED} == {name: theirs[name] for name in SHARED}
    assert mine["ssl_enabled"] == "no" and mine["ssl_chain_cert"] == "(null)" and mine["ssl_ca_cert"] == "NULL"


def binary_packet(opcode: int, key: bytes = b"", value: bytes = b"") -> bytes:
    body = key + value
    return struct.pack(">BBHBBHIIQ", 0x80, opcode, len(key), 0, 0, 0, len(body), 0, 0) + body


def read_packet(sock: socket.socket) -> tuple[int, int, bytes, bytes]:
    """(opcode, status, key, value) of one binary response."""
    header = b""
    while len(header) < 24:
        chunk = sock.recv(24 - len(header))
        assert chunk, "closed"
        header += chunk
    _, opcode, key_length, extras, _, status, total, _, _ = struct.unpack(">BBHBBHIIQ", header)
    body = b""
    while len(body) < total:
        chunk = sock.recv(total - len(body))
        assert chunk, "closed"
        body += chunk
    return opcode, status, body[extras : extras + key_length], body[extras + key_length :]


def test_binary_stat_settings_after_a_sasl_login(daemons: DaemonFactory, files: tuple[Certs, Path]) -> None:
    _, users = files
    d = daemons.start("--auth-file", str(users))
    with socket.create_connection(("127.0.0.1", d.port), timeout=5) as s:  # type: ignore[arg-type]
        s.sendall(binary_packet(0x21, b"PLAIN", f"\0{USER}\0{PASSWORD}".encode()))
        assert read_packet(s)[1] == 0, "logged in"
        s.sendall(binary_packet(0x10, b"settings"))
        fields = {}
        while True:
            opcode, status, key, value = read_packet(s)
            assert (opcode, status) == (0x10, 0)
            if not key:
                break
            fields[key.decode()] = value.decode()
    assert fields["auth_enabled_sasl"] == "yes" and fields["auth_enabled_ascii"] == str(users)
    assert fields["ssl_enabled"] == "no" and fields["login_timeout"] == "10"
