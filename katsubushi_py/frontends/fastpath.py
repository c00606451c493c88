"""The base classes of the sans-IO connections: where the compiled twin of the hot path plugs in.

``_speedups.TextCore`` and ``_speedups.BinaryCore`` (C) answer the common case of their protocol
themselves, complete gets whose IDs are all in the generator's current bucket, and hand everything
else to the connection's Python ``_receive_slow``, which is the whole protocol. To read the
connection's state without attribute lookups they keep it in C: ``_buffer``, ``_state``, ``closing``,
``wait``, ``backlog`` and ``activity``, and ``_spent`` (read-only), how many reply bytes the compiled
part made before it handed the rest over. :class:`PyConnectionCore` declares the same as slots (and
``_spent`` is always 0) and has no fast path, so with it the Python ``_receive_slow`` is ``receive``
itself (see :mod:`katsubushi_py.compiled` for when each runs).

The limits both twins share are here, and the compiled module exports its own copies, which a test
compares with these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..compiled import speedups

#: memcached's key limit: a longer key in a text get or a binary request is refused.
MAX_KEY = 250
#: One ``receive`` (or ``resume``) stops taking commands once its reply has reached this many bytes;
#: the rest of the input is held (``backlog``) until the connection has written that reply and calls
#: ``resume``. So one read of cheap requests that ask for large replies (a text ``get`` of many short
#: keys answers about 18 bytes for each byte, ``stats`` 150) never makes a reply of more than about
#: this much at once, and a client that does not read its replies is not read from.
REPLY_BUDGET = 64 * 1024
#: The compiled text core answers complete get lines of at most this many keys; the Python one
#: answers longer lines in batches of this many keys (one ``next_ids`` each).
GET_BATCH = 128


class PyConnectionCore:
    """The connection state shared with a compiled twin; no fast path of its own."""

    __slots__ = ("_buffer", "_state", "activity", "backlog", "closing", "wait")

    _buffer: bytes
    _state: int
    activity: int
    backlog: bool
    closing: bool
    wait: float
    #: Reply bytes the compiled core made before it handed the rest of a read over: none here.
    _spent = 0

    def _fast_init(self, generator: object, counters: object, max_line: int = 0, gets_fast: bool = False) -> None:
        """The compiled twin keeps what its fast path needs; nothing to do here."""


if TYPE_CHECKING or speedups is None:
    TextCore = BinaryCore = PyConnectionCore
else:
    TextCore = speedups.TextCore
    BinaryCore = speedups.BinaryCore

#: True when the connections derive from the compiled twins.
COMPILED = TextCore is not PyConnectionCore
