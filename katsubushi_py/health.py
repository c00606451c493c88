"""``katsubushi-py health``: ask a running daemon for one ID, the way the daemon was configured.

A health check that guesses the port reports a healthy daemon as unhealthy as soon as it was started
with ``--port`` or ``--sock`` (the old Dockerfile's HEALTHCHECK read only ``$PORT``). So the check
takes the daemon's own flags and environment variables, parsed by the daemon's own parser: either
given to it directly, or read from ``/proc/PID`` (``--pid 1`` in a container, where the daemon is
process 1 and a HEALTHCHECK sees neither its arguments nor anything set after it started).

Success is a real ``GET`` answered with a well-formed ID: a daemon that is up but cannot issue (clock
far behind, lease not confirmed) answers ``SERVER_ERROR`` and is reported unhealthy with its reason.
"""

from __future__ import annotations

import os
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass

_REQUEST = b"GET health\r\n"
_MAX_REPLY = 4096
_ANY_ADDRESS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "::": "::1", "[::]": "::1"}


class HealthError(Exception):
    """The daemon is not healthy, or cannot be reached: the message is the one line printed."""


@dataclass(frozen=True)
class Target:
    """One listener of the daemon: a TCP address or a unix socket path."""

    host: str | None
    port: int | None
    path: str | None

    @property
    def display(self) -> str:
        if self.path is not None:
            return self.path
        return f"[{self.host}]:{self.port}" if self.host and ":" in self.host else f"{self.host}:{self.port}"


def targets(host: str, port: int | None, sock: str | None) -> list[Target]:
    """Where to ask, from the daemon's listen settings (an any-address listener is asked on loopback)."""
    found = []
    if sock:
        found.append(Target(None, None, sock))
    if port is not None:
        if port == 0:
            raise HealthError("the daemon listens on port 0 (a random port); give the health check its real --port")
        found.append(Target(_ANY_ADDRESS.get(host.strip(), host.strip()), port, None))
    return found


def tls_targets(found: list[Target], settings: dict[str, object]) -> tuple[list[Target], ssl.SSLContext | None]:
    """With TLS on (``--tls-cert``): the TCP target becomes ``--plain-port`` on loopback when there is
    one, else it is asked over TLS without checking the certificate (it is this host's own daemon,
    found by its own flags). Mutual TLS (``--tls-verify require``) needs ``--plain-port`` for this."""
    if not settings.get("tls_cert"):
        return found, None
    if settings.get("plain_port"):
        plain = Target("127.0.0.1", int(str(settings["plain_port"])), None)
        return [plain if t.path is None else t for t in found], None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return found, context


def fetch_one_id(target: Target, timeout: float, login: bytes = b"", context: ssl.SSLContext | None = None) -> int:
    """Send ``GET health`` (after ``login``, a text login with noreply, when the daemon has
    --auth-file) and return the ID of a well-formed reply; raise HealthError otherwise.
    ``context``: over TLS to a TCP target."""
    deadline = time.monotonic() + timeout
    try:
        if target.path is not None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(timeout)
            try:
                conn.connect(target.path)
            except BaseException:
                conn.close()
                raise
        else:
            assert target.host is not None and target.port is not None
            conn = socket.create_connection((target.host, target.port), timeout=timeout)
            if context is not None:
                conn = context.wrap_socket(conn)
        with conn:
            conn.sendall(login + _REQUEST)
            reply = b""
            while not (reply.endswith(b"END\r\n") or (reply.endswith(b"\r\n") and not reply.startswith(b"VALUE"))):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                conn.settimeout(left)
                chunk = conn.recv(_MAX_REPLY)
                if not chunk:
                    break
                reply += chunk
                if len(reply) > _MAX_REPLY:
                    break
    except TimeoutError:
        raise HealthError(f"{target.display}: no answer within {timeout:g} s") from None
    except OSError as exc:
        raise HealthError(f"{target.display}: {exc.strerror or exc}") from None
    return _parse_reply(target, reply)


def _parse_reply(target: Target, reply: bytes) -> int:
    lines = reply.split(b"\r\n")
    if len(lines) == 4 and lines[2:] == [b"END", b""] and lines[0].startswith(b"VALUE health 0 "):
        value = lines[1]
        if value.isdigit() and lines[0] == b"VALUE health 0 %d" % len(value):
            return int(value)
    first = reply.split(b"\r\n", 1)[0][:200].decode("utf-8", "replace")
    if not reply:
        raise HealthError(f"{target.display}: the connection closed without an answer")
    raise HealthError(f"{target.display}: answered {first!r} instead of an ID")


def read_process(pid: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a process, from /proc (Linux)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = [part.decode("utf-8", "surrogateescape") for part in f.read().split(b"\0")[:-1]]
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = {}
            for entry in f.read().split(b"\0"):
                name, sep, value = entry.decode("utf-8", "surrogateescape").partition("=")
                if sep:
                    environ[name] = value
    except OSError as exc:
        raise HealthError(f"cannot read process {pid}: {exc.strerror or exc}") from None
    return cmdline, environ


# The settings the health check opens as paths: the unix socket it asks on, the auth file it logs in with.
_PATH_SETTINGS = ("sock", "auth_file")


def resolve_from_daemon(settings: dict[str, object], pid: int) -> dict[str, object]:
    """The daemon's relative paths (``--sock k.sock``, ``--auth-file auth``) as the daemon resolves
    them, from its own working directory (/proc/PID/cwd), not the health check's: a check run from
    elsewhere (a HEALTHCHECK, a shell in another directory) would otherwise report a healthy daemon as
    unhealthy. Abstract unix sockets (``@name``) are not paths."""
    relative = [
        k
        for k in _PATH_SETTINGS
        if isinstance(settings.get(k), str)
        and settings[k]
        and not os.path.isabs(str(settings[k]))
        and not str(settings[k]).startswith("@")
    ]
    if not relative:
        return settings
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError as exc:
        raise HealthError(
            f"cannot read the working directory of process {pid}, from which its relative"
            f" {', '.join('--' + k.replace('_', '-') for k in relative)} is resolved: {exc.strerror or exc}"
        ) from None
    return {**settings, **{k: os.path.join(cwd, str(settings[k])) for k in relative}}


def daemon_arguments(cmdline: Sequence[str], pid: int) -> list[str]:
    """The daemon's own arguments, after ``katsubushi-py`` or ``python -m katsubushi_py`` (and ``serve``)."""
    rest: list[str] | None = None
    for i, arg in enumerate(cmdline):
        if os.path.basename(arg) == "katsubushi-py":
            rest = list(cmdline[i + 1 :])
            break
        if arg == "-m" and cmdline[i + 1 : i + 2] == ["katsubushi_py"]:
            rest = list(cmdline[i + 2 :])
            break
    if rest is None:
        raise HealthError(f"process {pid} is not katsubushi-py: {' '.join(cmdline)[:200]!r}")
    if rest[:1] == ["serve"]:
        rest = rest[1:]
    elif rest and not rest[0].startswith("-"):
        raise HealthError(f"process {pid} runs 'katsubushi-py {rest[0]}', not the daemon")
    return rest
