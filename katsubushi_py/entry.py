"""The ``katsubushi-py`` command's entry point (``python -m katsubushi_py`` and the console script).

Before anything slow, a daemon about to start ignores SIGHUP. A reload (``kill -HUP``, ``systemctl
reload``, a certificate manager's hook) that arrives while the daemon starts -- importing, reading its
files, waiting for the clock to pass its state file's mark, leasing a worker id -- would otherwise take
the signal's default action and end the daemon. Ignoring it loses nothing: the files are read again
as the daemon starts to serve, after its own handler (a reload) is installed. Only
:mod:`katsubushi_py` itself is imported before this runs; :mod:`.cli` and everything it loads after.
The subcommands (``health``, ``get``, ...) keep the default: a tool ends on a hangup.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence


def serving(args: Sequence[str]) -> bool:
    """Whether these arguments start the daemon (options only, or the ``serve`` command)."""
    return not args or args[0].startswith("-") or args[0] == "serve"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if serving(args):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from .cli import main as cli_main

    return cli_main(args)
