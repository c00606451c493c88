"""What can stop an ID from being issued, each with a short ``reason`` that counters and metrics use.

A :class:`GenerationError` means "no ID can be issued right now": a front end answers it for the one
request that hit it (``SERVER_ERROR <message>`` in the text protocol) and the connection goes on.
:class:`ClockWait` is not a failure: the clock is a little behind the last issued millisecond and the
request should be retried after ``seconds``, without blocking anyone else meanwhile.
"""


class GenerationError(RuntimeError):
    """No ID can be issued right now."""

    reason = "error"


class ClockMovedBackwardsError(GenerationError):
    """The clock is behind the last issued millisecond by more than the generator may wait."""

    reason = "clock_backwards"


class LayoutExhaustedError(GenerationError):
    """The clock is past the layout's lifetime: no more IDs fit."""

    reason = "layout_exhausted"


class GeneratorClosedError(GenerationError):
    """The generator was closed (its final mark is stored); make a new one."""

    reason = "closed"


class StateFileError(GenerationError):
    """The state file cannot be read, is damaged, or cannot be written."""

    reason = "state_file"


class LeaseNotConfirmedError(GenerationError):
    """The worker id's lease is not confirmed (Redis unreachable, renew failed, or just acquired and
    still in its delay): issuing now could duplicate IDs of another holder of this worker id."""

    reason = "lease_unconfirmed"

    def __init__(self, message: str = "worker id lease not confirmed") -> None:
        super().__init__(message)


class ClockWait(Exception):
    """The clock is behind the last issued millisecond, within the bound the generator may wait.

    Raised only by a generator made with ``block_on_clock=False`` (the daemon's): the caller retries
    after ``seconds`` instead of blocking its thread, so an event loop keeps serving other clients and
    renewing its lease while one request waits.
    """

    def __init__(self, seconds: float) -> None:
        super().__init__(f"clock behind; retry in {seconds * 1000:.1f} ms")
        self.seconds = seconds
