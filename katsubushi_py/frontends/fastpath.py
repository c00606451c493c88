"""The base classes of the sans-IO connections: where the compiled twin of the hot path plugs in.

``_speedups.TextCore`` and ``_speedups.BinaryCore`` (C) answer the common case of their protocol
themselves, complete gets whose IDs are all in the generator's current bucket, and hand everything
else to the connection's Python ``_receive_slow``, which is the whole protocol. To read the
connection's state without attribute lookups they keep it in C: ``_buffer``, ``closing``, ``wait``
and ``activity``. :class:`PyConnectionCore` declares the same four as slots and has no fast path, so
with it the Python ``_receive_slow`` is ``receive`` itself (see :mod:`katsubushi_py.compiled` for
when each runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..compiled import speedups


class PyConnectionCore:
    """The connection state shared with a compiled twin; no fast path of its own."""

    __slots__ = ("_buffer", "activity", "closing", "wait")

    _buffer: bytes
    activity: int
    closing: bool
    wait: float

    def _fast_init(self, generator: object, counters: object, max_line: int = 0, gets_fast: bool = False) -> None:
        """The compiled twin keeps what its fast path needs; nothing to do here."""


if TYPE_CHECKING or speedups is None:
    TextCore = BinaryCore = PyConnectionCore
else:
    TextCore = speedups.TextCore
    BinaryCore = speedups.BinaryCore

#: True when the connections derive from the compiled twins.
COMPILED = TextCore is not PyConnectionCore
