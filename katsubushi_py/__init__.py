"""katsubushi-py: unique 64-bit IDs over the memcached protocol.

The pieces, one module each: :mod:`.layout` (the bits of an ID), :mod:`.generator` (issuing them),
:mod:`.statefile` (restart safety), :mod:`.encodings` (text forms), :mod:`.protocol` (memcached text
protocol, sans-IO), :mod:`.server` (asyncio daemon), :mod:`.config` (command line and environment),
:mod:`.tools` (decode, id-at, partitions) and :mod:`.cli` (the ``katsubushi-py`` command).
"""

from .errors import (
    ClockMovedBackwardsError,
    GenerationError,
    GeneratorClosedError,
    LayoutExhaustedError,
    StateFileError,
)
from .generator import Clock, Generator, SystemClock
from .layout import DEFAULT_LAYOUT, KATSUBUSHI_EPOCH_MS, DecodedID, Layout, LayoutError

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_LAYOUT",
    "KATSUBUSHI_EPOCH_MS",
    "Clock",
    "ClockMovedBackwardsError",
    "DecodedID",
    "GenerationError",
    "Generator",
    "GeneratorClosedError",
    "Layout",
    "LayoutError",
    "LayoutExhaustedError",
    "StateFileError",
    "SystemClock",
    "__version__",
]
