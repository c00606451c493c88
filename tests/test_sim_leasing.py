"""The deterministic simulation of leasing under faults (tests/sim_leasing.py): the real lease keeper and
generator, the real Lua scripts in a real redis-server, on a virtual clock, under storms of every fault
the simulator knows; every invariant checked after every step.

These tests show that the simulation holds (no violation over a few seeds), that it really injects
every kind of fault (so it cannot pass by doing nothing), that it finds bugs planted in the production
code, and that a failing seed replays exactly. The long run is ``python tests/sim_leasing.py --seeds N
--steps M`` (its figures are in docs/guarantees.md)."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from sim_leasing import PLANTED_BUGS, Faults, Result, planted_bug, run_seeds
from sim_redis_backend import SCRIPT_NAMES, SUBSTITUTIONS, simulated

from katsubushi_py.issuing.generator import Generator
from katsubushi_py.leasing import scripts as lease_scripts
from katsubushi_py.leasing.keeper import LeaseKeeper, LeaseTimings
from katsubushi_py.leasing.target import LeaseError, parse_redis_url

pytestmark = pytest.mark.once

# Seeds 1..12 draw worlds with 0, 1 and 2 replicas, replica_acks=0 and the default, 1 to 6 ids for 2 to 6
# hosts; 4,000 steps each is about 15 s on a quiet 2-core machine.
SEEDS = list(range(1, 13))
STEPS = 4000


def _totals(results: list[Result]) -> tuple[Counter[str], Counter[str]]:
    faults: Counter[str] = Counter()
    stats: Counter[str] = Counter()
    for r in results:
        faults.update(r.faults)
        stats.update(r.stats)
    return faults, stats


def test_leases_hold_under_every_fault() -> None:
    results = run_seeds(SEEDS, STEPS)
    failed = [f"seed {r.seed} at step {r.step_of_error}: {r.error} (replay: {r.replay()})" for r in results if r.error]
    assert not failed, "\n".join(failed)
    assert sum(r.steps for r in results) == len(SEEDS) * STEPS
    faults, stats = _totals(results)
    # Every kind of fault was injected, several times: a simulator whose faults stopped firing fails here.
    missing = [kind for kind in Faults.KINDS if faults[kind] < 2]
    assert not missing, f"faults never (or once only) injected: {missing}; injected: {dict(faults)}"
    assert sum(faults.values()) > 300
    # ... and they reached the keepers: leases lost and taken again, Redis seen restarting, failing over,
    # losing data, its clock stepping, ids quarantined, replicas not acknowledging.
    for counter in (
        "renewals",
        "acquires",
        "worker_id_changes",
        "data_loss_events",
        "redis_changes",
        "kept_through_change",
        "quarantined_ids",
        "master_changes",
        "redis_clock_steps",
        "replica_ack_failures",
        "renew_failures",
        "skipped_live_leases",
    ):
        assert stats[counter] > 0, f"no keeper counted {counter}: {dict(stats)}"
    # The daemons served between the storms: IDs issued by every world, and the fleet serving again at
    # the end of most calm stretches.
    assert all(r.ids > 1000 for r in results), [(r.seed, r.ids) for r in results]
    calm: Counter[str] = Counter()
    for r in results:
        calm.update(r.calm)
    assert calm["serving"] > 3 * calm["not serving"], dict(calm)


def test_a_seed_replays_exactly() -> None:
    first, second, other = run_seeds([7, 7, 8], 1500)
    assert first.error is None and second.error is None
    assert first.digest == second.digest
    assert (first.ids, first.faults, first.scripts, first.virtual_seconds) == (
        second.ids,
        second.faults,
        second.scripts,
        second.virtual_seconds,
    )
    assert other.digest != first.digest


@pytest.mark.parametrize(
    ("bug", "seed", "steps"),
    [
        # A daemon that ignores its lease deadline: paused or cut off past its lease, it issues beside the
        # daemon that took its id over.
        ("no-fence", 2, 800),
        # The bug this simulation found: the start-up clock check read the wall clock as it is now, so a
        # daemon started on a host whose clock NTP stepped right after its start issued IDs seconds off.
        # Fixed in LeaseKeeper.check_clock. Since the pool's high-water mark, a lost record no longer
        # shows it (seed 1 found it that way); here h0's daemon starts with its clock 16 s ahead, passes
        # the old check, and its IDs run ahead of the daemon that holds the worker id after it. (Seeds
        # move with the scripts and the faults: since every lease write counts the replicas, seed 41's
        # history is another one; since the rollback fault and presence (issue 32), seed 48's, and
        # no-fence's seed 27.)
        ("wall-clock-check", 236, 2940),
    ],
)
def test_a_planted_bug_is_found_and_its_seed_replays(bug: str, seed: int, steps: int) -> None:
    assert bug in PLANTED_BUGS
    with planted_bug(bug):
        found, again = run_seeds([seed, seed], steps)
    assert found.error is not None, f"the simulation did not find {bug} in seed {seed}"
    assert ("OVERLAP" in found.error) or ("DUPLICATE" in found.error) or ("after" in found.error), found.error
    # The failure replays exactly: the same step, the same message, the same history.
    assert (again.error, again.step_of_error, again.digest) == (found.error, found.step_of_error, found.digest)
    assert f"--plant {bug}" in found.replay()
    # Without the planted bug the same world holds.
    (fixed,) = run_seeds([seed], steps)
    assert fixed.error is None, fixed.error


def test_the_simulated_scripts_differ_from_the_real_ones_only_in_their_clock_and_identity() -> None:
    assert "ACQUIRE_COUNTED_LUA" in SCRIPT_NAMES and "RENEW_COUNTED_LUA" in SCRIPT_NAMES
    for name in SCRIPT_NAMES:
        real = getattr(lease_scripts, name)
        sim = simulated(real)
        back = sim
        for original, replacement in SUBSTITUTIONS:
            back = back.replace(replacement, original)
        assert back == real, name
        assert "redis.call('TIME')" not in sim and "redis.call('INFO'" not in sim, name


class _SteppedClock:
    """A host clock 8 s ahead when the daemon starts, put right by NTP before the clock check."""

    def __init__(self) -> None:
        self.offset_ns = 8_000_000_000

    def wall_ns(self) -> int:
        return time.time_ns() + self.offset_ns

    def monotonic_ns(self) -> int:
        return time.monotonic_ns()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class _RedisTime:
    async def time(self) -> tuple[int, int]:
        now = time.time()
        return int(now), int(now % 1 * 1e6)


async def test_the_clock_check_judges_the_clock_the_ids_carry() -> None:
    """The generator took its clock from the wall clock at start (8 s ahead); NTP then put the wall clock
    right. The wall clock agrees with Redis, the IDs would not: the daemon must refuse to lease."""
    clock = _SteppedClock()
    generator = Generator(1, clock=clock)
    clock.offset_ns = 0  # NTP steps the host's clock back
    keeper = LeaseKeeper(parse_redis_url("redis://127.0.0.1:1/0"), LeaseTimings(3, 1, 2), 1, 2, skew_max=1.0)
    keeper.link.client = _RedisTime()
    keeper.generator = generator
    with pytest.raises(LeaseError, match=r"local clock differs from Redis TIME by \+[78]\.\d+s"):
        await keeper.check_clock()
    # A generator whose clock agrees with Redis passes.
    keeper.generator = Generator(1, clock=clock)
    assert abs(await keeper.check_clock()) < 0.5
    keeper.link.client = None


@pytest.mark.parametrize(
    ("seed", "steps", "sign"),
    [
        # Two masters with a replica no lease write had counted (condition 3's residual case: a replica's
        # link cut and restored, then a partition before a lease write on the master saw it). Until issue
        # 32 the clock condition's seed was here (1020, 4761: the pool flushed while its holder was cut
        # off, Redis's clock 25 s back, a host synced to it); the rollback fault moved every history, and
        # a search of seeds 1000..1399 (5,000 steps) with --known-gaps reached only condition 3.
        (1045, 4485, "OVERLAP"),
    ],
)
def test_outside_the_conditions_the_documented_gaps_are_reached(seed: int, steps: int, sign: str) -> None:
    """With --known-gaps the faults leave the conditions docs/guarantees.md states (Clock; Leasing
    faults, condition 3), and the simulation finds the two gaps; the same seeds inside the conditions
    hold. If one of these starts passing, the gap was closed or the history changed: look."""
    (gap,) = run_seeds([seed], steps, known_gaps=True)
    assert gap.error is not None and sign in gap.error, gap.error
    assert "--known-gaps" in gap.replay()
    (inside,) = run_seeds([seed], steps)
    assert inside.error is None, inside.error


def test_two_masters_soon_after_a_replica_joined_hold() -> None:
    """Issue 23's two-masters window: a replica that joined a master was waited for only once the daemons
    asked the replica count again (once a minute; 3 ttl in the simulation), so a partition in that time
    let the old master confirm leases alone. Every lease write now counts the replicas in its own script,
    and the simulation partitions whenever every replica has been seen by one (no longer a minute later).
    The planted old link (``replicas-once-a-minute``) with two masters at any time reproduces the finding
    (seed 3010 until the rollback fault of issue 32 moved the histories; 3271 now); the residual case it
    was (no lease write on the master between the join and the cut) stays outside the conditions
    (docs/guarantees.md, condition 3)."""
    results = run_seeds([230003, 230004, 230015], 3000)
    assert [r.error for r in results] == [None, None, None], [r.replay() for r in results if r.error]
    assert sum(r.stats.get("two_masters_soon_after_a_replica_joined", 0) for r in results) >= 5
    with planted_bug("replicas-once-a-minute"):
        (old,) = run_seeds([3271], 2146, known_gaps=True)
    assert old.error is not None and "OVERLAP" in old.error, old.error
    assert old.stats.get("two_masters_with_an_uncounted_replica") == 1
