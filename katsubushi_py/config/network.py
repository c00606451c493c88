"""Where and how the daemon listens: the address, TLS (files loaded once, so that a bad certificate is
one line before anything listens), the request deadline, and the credential files."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from collections.abc import Mapping

from ..auth.credentials import AuthConfig, CredentialsError, check_files

# (daemon/tls.py imports only ssl and the standard library: no import circle)
from ..daemon.tls import MIN_VERSIONS, TlsConfig, TlsError, build_contexts
from .values import DEFAULT_PORT, DEFAULT_REQUEST_TIMEOUT, ConfigError, bounded_int, parse_duration


def listen_settings(given: Mapping[str, object]) -> tuple[str, int | None, str | None]:
    """(host, port or None, unix socket path or None) as the daemon listens with these settings."""
    sock = str(given.get("sock") or "") or None
    port_given = "port" in given
    port: int | None = bounded_int(given["port"], "port", 0, 65535) if port_given else DEFAULT_PORT
    if sock and not port_given:
        port = None  # as in katsubushi: --sock alone means unix socket only
    return str(given.get("host", "127.0.0.1")), port, sock


_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def check_host(host: str) -> None:
    """--host must be an IP address or a host name: ``999.1.1.1`` or ``10.0.0.1:80`` is a usage error
    (exit 2), not a failed start. A well-formed name that does not resolve is left to the bind (exit 1:
    DNS may not be up yet, and a restart can fix that)."""
    if not host:
        raise ConfigError("invalid --host '': give an address (0.0.0.0 or :: for every interface)")
    if re.fullmatch(r"[0-9.]+", host) or ":" in host:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            hint = " (give the port with --port)" if re.fullmatch(r"[^:]+:\d+", host) else ""
            raise ConfigError(f"invalid --host {host!r}: not an IP address{hint}") from None
    elif len(host) > 253 or not _HOST_NAME.fullmatch(host):
        raise ConfigError(f"invalid --host {host!r}: not an IP address or a host name")


def check_parent_directory(path: str, option: str) -> None:
    """A missing directory is named, so the user knows what to create (and by whom: the daemon's user)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(
            f"{option} {path}: directory {parent} does not exist; create it (mkdir -p {parent})"
            " and make it writable by the daemon's user"
        )


def tls_settings(given: Mapping[str, object], idle: float) -> tuple[TlsConfig | None, int | None, float]:
    """(TLS configuration or None, --plain-port or None, request deadline in seconds); the files are
    loaded once here, so that a missing file, a key that does not match the certificate or an expired
    certificate is one line and exit status 2 before anything listens."""
    timeout = parse_duration(str(given.get("request_timeout", DEFAULT_REQUEST_TIMEOUT)), "--request-timeout")
    if idle > 0 and (timeout == 0 or timeout > idle):
        timeout = idle  # the idle timeout closes a stalled request anyway
    cert = str(given.get("tls_cert") or "") or None
    if cert is None:
        for name in ("tls_key", "tls_ca", "tls_verify", "tls_min_version", "tls_ciphers", "plain_port"):
            if name in given:
                raise ConfigError(f"--{name.replace('_', '-')} needs --tls-cert (TLS is off without it)")
        return None, None, timeout
    ca = str(given.get("tls_ca") or "") or None
    verify = str(given.get("tls_verify") or ("require" if ca else "none"))
    if verify != "none" and ca is None:
        raise ConfigError(f"--tls-verify {verify} needs --tls-ca (the CAs whose client certificates to accept)")
    version = str(given.get("tls_min_version", "1.2")).lower()
    if version not in MIN_VERSIONS:
        raise ConfigError(f"invalid --tls-min-version {version!r}: use 1.2 or 1.3")
    version = "1.3" if MIN_VERSIONS[version].name.endswith("3") else "1.2"
    config = TlsConfig(
        cert=cert,
        key=str(given.get("tls_key") or "") or None,
        ca=ca,
        verify=verify,
        min_version=version,
        ciphers=str(given.get("tls_ciphers") or "") or None,
    )
    try:
        build_contexts(config)
    except TlsError as exc:
        raise ConfigError(str(exc)) from None
    plain = bounded_int(given["plain_port"], "plain port", 1, 65535) if "plain_port" in given else None
    return config, plain, timeout


def auth_config(args: argparse.Namespace) -> AuthConfig | None:
    """The credential files, each read once here so that a bad one is the one line of a failed start."""
    auth_file = str(getattr(args, "auth_file", "") or "") or None
    token_file = str(getattr(args, "token_file", "") or "") or None
    metrics_no_auth = bool(getattr(args, "metrics_no_auth", False))
    if metrics_no_auth and token_file is None:
        raise ConfigError("--metrics-no-auth needs --token-file")
    login_timeout = parse_duration(str(getattr(args, "login_timeout", "10s")), "--login-timeout")
    if login_timeout <= 0:
        raise ConfigError("--login-timeout must be more than 0")
    if hasattr(args, "login_timeout") and auth_file is None and token_file is None:
        raise ConfigError("--login-timeout needs --auth-file or --token-file")
    if auth_file is None and token_file is None:
        return None
    config = AuthConfig(auth_file, token_file, metrics_no_auth, login_timeout)
    try:
        check_files(config)
    except CredentialsError as exc:
        raise ConfigError(str(exc)) from None
    return config
