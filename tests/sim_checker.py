"""The invariants of the leasing simulation (tests/sim_leasing.py), checked after every step: no ID issued
twice, IDs increasing under each worker id whoever issues them, no two daemons able to issue under one
worker id at once (nor one issuing under it again once another has), and a daemon issuing only under
the lease its keeper holds.

Apart from the world (sim_world.py) and the faults (sim_faults.py) on purpose: the checker reads only
what the daemons issued and what their generators would answer, never the simulator's own bookkeeping,
so a simulator bug cannot hide a violation by agreeing with itself.
"""

from __future__ import annotations

from collections import Counter

from sim_model import BASE_UNIX, WORKER_MASK, WORKER_SHIFT, Process, Violation


def _ms_of(id_: int) -> str:
    """An ID's millisecond, as true time of the simulation (seconds)."""
    return f"t={((id_ >> 22) + 1_420_070_400_000) / 1000 - BASE_UNIX:.3f}"


def _clock_of(process: Process, now: float) -> str:
    """How far the process's generator clock is from true time."""
    generator = process.generator
    if generator is None:
        return "?"
    return f"{generator.now_ms() / 1000 - BASE_UNIX - now:+.3f}s"


class Checker:
    """The invariants over every ID issued, and over who could issue at each step."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.last: dict[int, int] = {}  # worker id -> the last ID issued under it
        self.last_by: dict[int, str] = {}  # worker id -> who issued it, when (true time), with what clock
        self.owner: dict[int, str] = {}  # worker id -> the lease token that issued under it last
        self.retired: set[tuple[int, str]] = set()
        self.ids = 0
        self.requests = 0
        self.refused: Counter[str] = Counter()
        self.serving_time: dict[int, float] = {}

    def issued(self, process: Process, ids: list[int], now: float) -> None:
        keeper, generator = process.keeper, process.generator
        assert keeper is not None and generator is not None
        holding = keeper.holding
        if holding is None:
            raise Violation(f"{process.name} issued {len(ids)} IDs without holding a lease")
        worker, token = holding.worker_id, holding.lease.token
        for id_ in ids:
            if (id_ >> WORKER_SHIFT) & WORKER_MASK != worker:
                raise Violation(
                    f"{process.name} issued {id_} (worker id {(id_ >> WORKER_SHIFT) & WORKER_MASK})"
                    f" under its lease on worker id {worker}"
                )
        before = len(self.seen)
        self.seen.update(ids)
        if len(self.seen) != before + len(ids):
            dup = [i for i in ids if ids.count(i) > 1] or ids
            raise Violation(f"DUPLICATE: {process.name} issued an ID issued before (one of {dup[:3]}...)")
        last = self.last.get(worker)
        if last is not None and ids[0] <= last:
            raise Violation(
                f"{process.name} issued {ids[0]} under worker id {worker} ({_ms_of(ids[0])}, clock"
                f" {_clock_of(process, now)}) after {last} ({_ms_of(last)}) was issued by {self.last_by[worker]}"
            )
        self.last[worker] = ids[-1]
        self.last_by[worker] = f"{process.name} at {now:.3f} (clock {_clock_of(process, now)})"
        owner = self.owner.get(worker)
        if owner != token:
            if (worker, token) in self.retired:
                raise Violation(f"OVERLAP: {process.name} issued under worker id {worker} again after lease {owner}")
            if owner is not None:
                self.retired.add((worker, owner))
            self.owner[worker] = token
        self.ids += len(ids)

    def could_issue(self, processes: list[Process], now: float) -> None:
        """At most one daemon per worker id could issue right now."""
        seen: dict[int, Process] = {}
        for process in processes:
            generator = process.generator
            if not process.live or process.paused_until > now or generator is None:
                continue
            if generator.check() is not None:
                continue
            worker = generator.worker_id
            other = seen.get(worker)
            if other is not None:
                raise Violation(f"OVERLAP: {other.name} and {process.name} could both issue under worker id {worker}")
            seen[worker] = process
