"""systemd socket activation: listening sockets inherited through ``LISTEN_FDS`` (sd_listen_fds(3)).

With ``katsubushi-py.socket``, systemd owns the listening sockets: it opens them before the daemon
starts and keeps them open across restarts, so clients connecting during a restart wait in the
backlog instead of being refused. The daemon then serves on those sockets instead of binding its own.
The protocol is tiny (file descriptors 3, 4, ... and two variables), so it is read here directly
rather than through a binding to libsystemd.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

LISTEN_FDS_START = 3
_VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


class ActivationError(ValueError):
    """The inherited sockets cannot be used; the message says which and why."""


def inherited_sockets(environ: MutableMapping[str, str] = os.environ) -> list[socket.socket]:
    """The listening sockets systemd passed to this process, or [] when it passed none.

    Only when ``LISTEN_PID`` is this process (the variables may have leaked from a parent). The
    variables are then removed so that nothing this process starts believes it was activated, and the
    descriptors are made close-on-exec, as sd_listen_fds(1) does.
    """
    pid, count = environ.get("LISTEN_PID"), environ.get("LISTEN_FDS")
    if not pid or not count:
        return []
    try:
        if int(pid) != os.getpid():
            return []
        number = int(count)
    except ValueError:
        raise ActivationError(f"LISTEN_PID={pid!r} LISTEN_FDS={count!r} are not numbers") from None
    for name in _VARIABLES:
        environ.pop(name, None)
    sockets = []
    for fd in range(LISTEN_FDS_START, LISTEN_FDS_START + number):
        try:
            os.set_inheritable(fd, False)
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            raise ActivationError(f"inherited file descriptor {fd} is not a socket: {exc.strerror or exc}") from None
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.detach()
            raise ActivationError(
                f"inherited file descriptor {fd} is not a listening stream socket (use ListenStream=, Accept=no)"
            )
        sock.setblocking(False)
        sockets.append(sock)
    return sockets


def describe(sock: socket.socket) -> str:
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        if isinstance(name, bytes):  # Linux abstract namespace
            return "@" + name[1:].decode("utf-8", "replace")
        return name or "unnamed unix socket"
    host, port = name[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
