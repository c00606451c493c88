"""Which implementation of the hot path runs: the compiled twin or the pure-Python reference.

``katsubushi_py._speedups`` (C, built by ``pip install`` where a compiler exists) holds compiled twins
of five small hot-path pieces: the generator's bucket (:class:`~.issuing.bucket.PyGeneratorCore`),
the per-protocol counters (:class:`~.issuing.issuer.PyCounters`), the fast cases of the text and
binary protocols (:class:`~.frontends.fastpath.PyConnectionCore`), the asyncio protocol's
``data_received`` (:class:`~.daemon.connection.PyProtocolCore`) and the socket transport's read and
write (:class:`~.daemon.sockets.PySocketCore`; with the compiled path the memcached listeners are
served on that transport instead of the event loop's streams, see :mod:`~.daemon.sockets`). Each
pure-Python class stays the reference: it is what runs when the module is not built, when
``KATSUBUSHI_NO_EXTENSIONS`` is set (to anything but ``0``), and on a free-threaded CPython (the
compiled fast paths rely on the GIL). The test suite runs both ways (``.ci/run``), and STATS reports
``implementation``.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

#: True on a free-threaded CPython (3.13t and later) running without the GIL.
FREE_THREADED = not getattr(sys, "_is_gil_enabled", lambda: True)()

speedups: ModuleType | None = None
WHY_NOT_COMPILED = ""

if os.environ.get("KATSUBUSHI_NO_EXTENSIONS", "") not in ("", "0"):
    WHY_NOT_COMPILED = "KATSUBUSHI_NO_EXTENSIONS is set"
elif FREE_THREADED:
    WHY_NOT_COMPILED = "free-threaded CPython (the compiled fast paths rely on the GIL)"
else:
    try:
        from . import _speedups as speedups
    except ImportError as exc:  # not built here (no compiler at install time)
        # A module that is not there at all shows up, from inside the package's own import, as Python's
        # "cannot import name ... (most likely due to a circular import)": say what happened instead.
        from importlib.util import find_spec

        if find_spec(f"{__package__}._speedups") is None:
            WHY_NOT_COMPILED = (
                "not built: the compiled module katsubushi_py._speedups is not installed, as pip builds it"
                " only where a C compiler and the Python headers are found"
            )
        else:  # there, but it does not load (built for another Python, a missing library)
            WHY_NOT_COMPILED = f"not built for this Python, or it does not load ({exc})"

#: ``katsubushi_py._grpc_speedups``: the compiled twin of the gRPC fast path (frontends/grpc_fast.py
#: PyGrpcCore), a module of its own, built and chosen under the same rules.
grpc_speedups: ModuleType | None = None
if speedups is not None:
    try:
        from . import _grpc_speedups as grpc_speedups
    except ImportError:  # not built here: the gRPC front end runs its pure-Python fast path
        grpc_speedups = None

#: "compiled" or "python": what STATS shows as ``implementation``.
IMPLEMENTATION = "compiled" if speedups is not None else "python"
