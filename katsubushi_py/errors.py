"""Errors that mean "no ID can be issued right now".

The server turns each into ``SERVER_ERROR <message>`` for the one command that hit it; the
connection and the daemon go on.
"""


class GenerationError(RuntimeError):
    """No ID can be issued right now."""


class ClockMovedBackwardsError(GenerationError):
    """The clock is behind the last issued millisecond by more than the generator may wait."""


class LayoutExhaustedError(GenerationError):
    """The clock is past the layout's lifetime: no more IDs fit."""


class GeneratorClosedError(GenerationError):
    """The generator was closed (its final mark is stored); make a new one."""


class StateFileError(GenerationError):
    """The state file cannot be read, is damaged, or cannot be written."""


class LeaseNotConfirmedError(GenerationError):
    """The worker id's lease is not confirmed (Redis unreachable, renew failed, or just acquired and
    still in its delay): issuing now could duplicate IDs of another holder of this worker id."""

    def __init__(self) -> None:
        super().__init__("worker id lease not confirmed")
