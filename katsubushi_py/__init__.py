"""katsubushi-py: unique 64-bit IDs over the memcached protocol.

A package per layer, from the bottom up:

- :mod:`.ids`: what an ID is (layout, encodings) and the tools that read IDs (decode, id-at, partitions);
- :mod:`.issuing`: the generator, its state file, and the issuer every front end asks for IDs;
- :mod:`.leasing`: worker ids leased from Redis;
- :mod:`.frontends`: the wire protocols, sans-IO (bytes in, bytes out);
- :mod:`.daemon`: the asyncio server around them;
- :mod:`.config` and :mod:`.cli`: the ``katsubushi-py`` command.
"""

from .ids.layout import DEFAULT_LAYOUT, KATSUBUSHI_EPOCH_MS, DecodedID, Layout, LayoutError
from .issuing.errors import (
    ClockMovedBackwardsError,
    GenerationError,
    GeneratorClosedError,
    LayoutExhaustedError,
    StateFileError,
)
from .issuing.generator import Clock, Generator, SystemClock

__version__ = "1.0.0"

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
