"""The faults of the leasing simulation (tests/sim_leasing.py): what can go wrong in a world, and when.

One class, :class:`Faults`, because the kinds share one schedule (storms and calm stretches), one
random stream (the world's seed) and one bookkeeping of when the faults so far have played out; each
kind is a method named as it is counted (``Faults.KINDS``; tests/test_sim_leasing.py checks each is
injected). The simulation (sim_world.py) calls :meth:`Faults.step` after every step; the faults act on
the daemons through the simulation (crash, stop, restart) and on Redis through sim_redis.py's world.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

from sim_loop import ROOT
from sim_model import Process

if TYPE_CHECKING:
    from sim_world import Simulation


class Faults:
    """What can go wrong, and when: storms (faults at ``config.fault_rate`` per step, for 150 to 600
    steps) and calm stretches (no new fault, every clock put right, and long enough after the last
    fault played out that the fleet serves again: a recovery window, a ttl and a renew interval).

    Topology faults (a Redis restart, a failover, two masters) are exclusive: one plays out to its end
    (the node back, the old master rejoined, the partition healed) before the next may start; the
    others (daemons, clocks, the network, records, replicas) overlap freely."""

    KINDS = (
        "pause",
        "crash",
        "stop",
        "host_clock",
        "host_ntp",
        "redis_clock",
        "restart",
        "failover",
        "two_masters",
        "replica_link",
        "slow_replica",
        "redis_pause",
        "damage",
        "rollback",
        "net",
        "lost_replies",
        "reboot",
    )

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.rng = sim.rng
        self.counts: Counter[str] = Counter()
        self.phase = "calm"  # the world starts calm: the fleet leases its ids first
        self.storms = 0
        self.storm_until_step = 0
        self.calm_until = sim.config.recovery + sim.config.ttl
        self.settled_at = 0.0  # true time by which every fault so far has played out
        self.topology_busy: str | None = None  # the topology fault in progress: one at a time

    def weights(self) -> dict[str, float]:
        sim, config = self.sim, self.sim.config
        redis = sim.redis
        master = redis.master
        master_replicas = [n for n in redis.nodes if n.role == "replica" and n.up and n.master is master]
        has_replicas = master is not None and bool(master_replicas)
        topology = master is not None and master.up and redis.partitioned is None and self.topology_busy is None
        # Every lease write counts the master's replicas (docs/leasing.md): a replica is waited for from
        # the first lease write that sees it connected. Two masters before any has (a replica that joined,
        # cut off before a lease write on that master) are the residual gap (--known-gaps).
        if master is not None and not sim.known_gaps and any(r.name not in master.counted for r in master_replicas):
            has_two_masters_replicas = False
        else:
            has_two_masters_replicas = has_replicas
        w = {
            "pause": 3.0,
            "crash": 2.0,
            "stop": 2.0,
            "host_clock": 1.5,
            "host_ntp": 1.0,
            "reboot": 1.0,
            "redis_clock": 1.5,
            "restart": 1.0 if topology else 0.0,
            "failover": 1.0 if has_replicas and topology else 0.0,
            "two_masters": 2.0 if has_two_masters_replicas and topology and config.replica_acks is None else 0.0,
            "replica_link": 1.0 if any(n.role == "replica" and n.up and n.link_up for n in redis.nodes) else 0.0,
            "slow_replica": 0.5 if any(n.role == "replica" for n in redis.nodes) else 0.0,
            "redis_pause": 1.0 if master is not None and master.up else 0.0,
            "damage": 1.5 if master is not None and master.up else 0.0,
            "rollback": 1.0 if topology else 0.0,
            "net": 2.0,
            "lost_replies": 1.0,
        }
        return {k: v for k, v in w.items() if v > 0}

    def step(self) -> None:
        sim = self.sim
        now = sim.loop.now
        if self.phase == "storm":
            if sim.step_no >= self.storm_until_step:
                self.phase = "calm"
                self.calm_until = self.settled_at  # then: every clock right, and the recovery (below)
                sim.trace(f"calm (storm {self.storms} over)")
            elif self.rng.random() < sim.config.fault_rate:
                weights = self.weights()
                kind = self.rng.choices(list(weights), list(weights.values()))[0]
                getattr(self, kind)()
            return
        if self.calm_until <= self.settled_at:
            # The last storm's faults have played out (or will, by settled_at): once they have, NTP puts
            # every clock right, and the calm goes on until the fleet has had time to serve again.
            if now < self.settled_at:
                return
            self.put_clocks_right()
            config = sim.config
            self.calm_until = now + config.recovery + config.ttl + config.timings.renew + 1.0
            return
        if now >= self.calm_until:
            if self.storms:
                sim.calm_ended()
            self.phase = "storm"
            self.storms += 1
            self.storm_until_step = sim.step_no + self.rng.randint(150, 600)
            sim.trace(f"storm {self.storms}")

    def put_clocks_right(self) -> None:
        """NTP on every host and node: clocks within a fifth (Redis) and two fifths (hosts) of the
        allowed skew of true time, so any daemon's within the skew of any node's."""
        skew = self.sim.config.skew_max
        for node in self.sim.redis.nodes:
            if abs(node.clock_offset) > 0.2 * skew:
                node.clock_offset = self.rng.uniform(-0.2, 0.2) * skew
                self.sim.trace(f"NTP: {node.name}'s clock to {node.clock_offset:+.3f}s")
        for host in self.sim.hosts:
            if abs(host.clock.offset) > 0.4 * skew:
                host.clock.step(self.rng.uniform(-0.4, 0.4) * skew - host.clock.offset)
                self.sim.trace(f"NTP: {host.name}'s clock to {host.clock.offset:+.3f}s")

    def _busy(self, seconds: float) -> None:
        """This fault plays out for ``seconds`` from now."""
        self.settled_at = max(self.settled_at, self.sim.loop.now + seconds)

    def _topology_done(self) -> None:
        self.topology_busy = None
        self._busy(0.0)

    def _event(self, kind: str, what: str) -> None:
        self.counts[kind] += 1
        self.sim.trace(f"FAULT {kind}: {what}")

    def _process(self) -> Process | None:
        live = [h.process for h in self.sim.hosts if h.process is not None and h.process.live]
        return self.rng.choice(live) if live else None

    def _later(self, delay: float, callback: Any, *args: Any) -> None:
        self._busy(delay)
        self.sim.loop.call_at(self.sim.loop.now + delay, callback, *args, context=ROOT)

    def _outage(self, short: float) -> float:
        """How long a daemon is paused or cut off: briefly (up to ``short``), up to a ttl, or for up to
        four (past its lease). Draws the three lengths, then picks one: a seed's history depends on it."""
        ttl, rng = self.sim.config.ttl, self.rng
        return rng.choice((rng.uniform(0.05, short), rng.uniform(short, ttl), rng.uniform(ttl, 4 * ttl)))

    # -- daemons -------------------------------------------------------------------------------------
    def pause(self) -> None:
        process = self._process()
        if process is None:
            return
        length = self._outage(0.5)
        until = max(process.paused_until, self.sim.loop.now + length)
        process.paused_until = until
        self._busy(length)
        self._event("pause", f"{process.name} for {length:.3f}s")
        # The requests that waited in its sockets meanwhile are served as it wakes, before any reply
        # from Redis can reach it (its own callbacks resume a microsecond later: sim_loop's gate).
        self._later(until - self.sim.loop.now, self.sim.woken, process, until)

    def crash(self) -> None:
        process = self._process()
        if process is None:
            return
        self._event("crash", process.name)
        self.sim.crash(process)
        delay = self.rng.uniform(0.1, 2 * self.sim.config.ttl)
        self._busy(delay)
        self.sim.restart_later(process.host, delay)

    def stop(self) -> None:
        process = self._process()
        if process is None or process.paused_until > self.sim.loop.now:
            return
        self._event("stop", process.name)
        self.sim.stop(process)
        delay = self.rng.uniform(0.0, self.sim.config.ttl)
        self._busy(delay + 1.5)
        self.sim.restart_later(process.host, delay)

    def host_clock(self) -> None:
        host = self.rng.choice(self.sim.hosts)
        step = self.rng.choice((-1, 1)) * self.rng.uniform(0.01, 2.5 * self.sim.config.skew_max)
        if self.rng.random() < 0.2:
            step = self.rng.choice((-1, 1)) * self.rng.uniform(5, 60)
        host.clock.step(step)
        self._event("host_clock", f"{host.name} {step:+.3f}s")

    def reboot(self) -> None:
        """A host reboots with its clock off (no RTC battery, a VM restored), and its daemon starts before
        NTP has synced and before the network is up; NTP then steps the clock right while the daemon is
        still connecting. The daemon must judge the clock its IDs carry (the generator's, taken at its
        start), not the wall clock as it reads when Redis answers at last."""
        sim, rng = self.sim, self.rng
        host = rng.choice(sim.hosts)
        if host.process is not None and host.process.state in ("running", "stopping"):
            sim.crash(host.process)
        step = rng.choice((-1, 1)) * rng.uniform(2 * sim.config.skew_max, 30.0)
        host.clock.step(step - host.clock.offset)
        host.restart_at = -1.0  # any restart already planned is this one
        sim.start(host)
        process = host.process
        if process is None or not process.live:
            return
        network = rng.uniform(0.3, 3.0)
        process.net_down_until = sim.loop.now + network
        ntp = rng.uniform(0.1, 0.9) * network

        def synced() -> None:
            host.clock.step(rng.uniform(-0.4, 0.4) * sim.config.skew_max - host.clock.offset)
            sim.trace(f"NTP: {host.name}'s clock to {host.clock.offset:+.3f}s")

        what = f"{host.name} with its clock {step:+.3f}s off; NTP in {ntp:.3f}s, network in {network:.3f}s"
        self._event("reboot", what)
        self._later(ntp, synced)
        self._busy(network)

    def host_ntp(self) -> None:
        """NTP puts a host's wall clock within two fifths of the allowed skew of its source: true time, or
        (half the time) the Redis host's clock, which may be off by seconds; its daemon then passes the
        clock check with IDs that far off true time (covered outside a loss of Redis's data; see
        Simulation.clocks_off_for_a_loss)."""
        host = self.rng.choice(self.sim.hosts)
        target = self.rng.uniform(-0.4, 0.4) * self.sim.config.skew_max
        master = self.sim.redis.master
        if master is not None and self.rng.random() < 0.5:
            target += master.clock_offset  # a host whose NTP source is the Redis host
        host.clock.step(target - host.clock.offset)
        self._event("host_ntp", f"{host.name} to {target:+.3f}s")

    # -- Redis -------------------------------------------------------------------------------------
    def redis_clock(self) -> None:
        node = self.sim.redis.master or self.rng.choice(self.sim.redis.nodes)
        size = self.rng.choice((self.rng.uniform(0.05, 1.0), self.rng.uniform(1.0, 5.0), self.rng.uniform(5.0, 30.0)))
        step = self.rng.choice((-1, 1)) * size
        node.clock_offset += step
        self._event("redis_clock", f"{node.name} {step:+.3f}s")

    def restart(self) -> None:
        redis, rng, ttl = self.sim.redis, self.rng, self.sim.config.ttl
        node = redis.master
        if node is None or not node.up:
            return
        mode = rng.choice(("flush", "rdb", "rdb", "aof", "clean"))
        if mode != "clean" and self.sim.loss_held("restart"):
            return
        age = {"flush": 0.0, "rdb": rng.uniform(0, 3 * ttl), "aof": rng.uniform(0, 1.0), "clean": 0.0}[mode]
        down = rng.choice((rng.uniform(0.01, 0.5), rng.uniform(0.5, ttl), rng.uniform(ttl, 2 * ttl)))
        dumps = tuple(None for _ in redis.keys) if mode == "flush" else redis.state_at(node, redis.loop.now - age)
        redis.stop_node(node)
        self.topology_busy = "restart"
        self._event("restart", f"{node.name} ({mode}, snapshot {age:.3f}s old, down {down:.3f}s)")

        def back() -> None:
            redis.start_node(node, dumps)
            self.sim.trace(f"{node.name} back (run_id {node.run_id[:8]})")
            self._topology_done()

        self._later(down, back)

    def failover(self) -> None:
        redis, rng = self.sim.redis, self.rng
        old = redis.master
        replicas = [n for n in redis.nodes if n.role == "replica" and n.up and n.master is old]
        if old is None or not replicas or self.sim.loss_held("failover"):
            return
        chosen = rng.choice(replicas)
        lag = rng.random() < 0.5
        cut = rng.uniform(0.05, 2.0) if lag else 0.0
        if lag:
            chosen.link_up = False
        self.topology_busy = "failover"
        self._event("failover", f"{old.name} -> {chosen.name}" + (f" (its link cut {cut:.3f}s before)" if lag else ""))

        def kill() -> None:
            if redis.master is not old or not old.up:
                chosen.link_up = True
                self._topology_done()
                return
            redis.stop_node(old)
            redis.master = None
            self.sim.trace(f"{old.name} killed; Sentinel promotes {chosen.name}")
            self._later(rng.uniform(0.2, 0.5 * self.sim.config.ttl), promote)

        def promote() -> None:
            if not chosen.up:
                chosen.link_up = True
                redis.master = old if old.up else None
                if redis.master is None:
                    redis.start_node(old, redis.state_at(old, redis.loop.now))
                    redis.master = old
                self._topology_done()
                return
            chosen.link_up = True
            redis.promote(chosen)
            self.sim.trace(f"{chosen.name} promoted (replid {chosen.replid[:8]})")
            self._later(rng.uniform(1.0, 4 * self.sim.config.ttl), rejoin)

        def rejoin() -> None:
            if not old.up and redis.master is not None:
                old.role = "replica"
                old.master = redis.master
                redis.start_node(old, tuple(None for _ in redis.keys))
                self.sim.trace(f"{old.name} back as a replica of {redis.master.name}")
            self._topology_done()

        self._later(cut, kill)

    def two_masters(self) -> None:
        """A partition: the master, cut off from its replicas and from Sentinel, keeps running with some
        daemons on its side; Sentinel promotes a replica for the others. Healed later: the old master
        becomes a replica of the new."""
        redis, rng, sim = self.sim.redis, self.rng, self.sim
        old = redis.master
        replicas = [n for n in redis.nodes if n.role == "replica" and n.up and n.master is old]
        if old is None or not replicas:
            return
        chosen = rng.choice(replicas)
        # Figures: two masters soon after a replica joined (inside the minute the daemons once took to
        # count it: 3 ttl in the simulation, plus 2 ttl), and with a replica no lease write had counted.
        if any(sim.loop.now - old.joined.get(r.name, -math.inf) < 5 * sim.config.ttl for r in replicas):
            sim.stats["two_masters_soon_after_a_replica_joined"] += 1
        if any(r.name not in old.counted for r in replicas):
            sim.stats["two_masters_with_an_uncounted_replica"] += 1
        for replica in replicas:
            replica.link_up = False
        stuck = [p for h in sim.hosts if (p := h.process) is not None and p.live and rng.random() < 0.5]
        for process in stuck:
            redis.pinned[process] = old
        redis.partitioned = old
        redis.master = None
        self.topology_busy = "two_masters"
        length = rng.uniform(0.5 * sim.config.ttl, 4 * sim.config.ttl)
        names = [p.name for p in stuck]
        self._event("two_masters", f"{old.name} cut off with {names}; {chosen.name} promoted; {length:.3f}s")

        def promote() -> None:
            if chosen.up:
                chosen.link_up = True
                redis.promote(chosen)

        def heal() -> None:
            redis.pinned.clear()
            redis.partitioned = None
            new = redis.master
            if new is None:
                self._topology_done()
                return
            if old.up:
                redis.demote(old, new)
            for replica in replicas:
                if replica is not new and replica.up and replica.master is not new:
                    redis.attach(replica, new)
            sim.trace(f"partition healed: {old.name} now a replica of {new.name}")
            self._topology_done()

        self._later(rng.uniform(0.2, 0.5 * sim.config.ttl), promote)
        self._later(length, heal)

    def replica_link(self) -> None:
        redis = self.sim.redis
        replicas = [n for n in redis.nodes if n.role == "replica" and n.up and n.link_up]
        if not replicas:
            return
        replica = self.rng.choice(replicas)
        replica.link_up = False
        length = self.rng.uniform(0.1, 2 * self.sim.config.ttl)
        self._event("replica_link", f"{replica.name} cut for {length:.3f}s")

        def restore() -> None:
            if replica.up and replica.master is not None and replica.role == "replica" and not replica.link_up:
                redis.attach(replica, replica.master)

        self._later(length, restore)

    def slow_replica(self) -> None:
        replicas = [n for n in self.sim.redis.nodes if n.role == "replica"]
        if replicas:
            replica = self.rng.choice(replicas)
            replica.slow = not replica.slow
            self._event("slow_replica", f"{replica.name} {'slow' if replica.slow else 'fast again'}")

    def redis_pause(self) -> None:
        node = self.sim.redis.master
        if node is None:
            return
        length = self.rng.choice((self.rng.uniform(0.05, 1.0), self.rng.uniform(1.0, 2 * self.sim.config.ttl)))
        node.paused_until = max(node.paused_until, self.sim.loop.now + length)
        self._busy(length)
        self._event("redis_pause", f"{node.name} for {length:.3f}s")

    def damage(self) -> None:
        """A held id's record damaged as docs/leasing.md lists (an edit, a bad restore, a script bug):
        expiry 0, mark 0, both, the mark deleted, the owner entry deleted, a release entry beside it."""
        redis = self.sim.redis
        node = redis.master
        if node is None or not node.up or node.paused_until > redis.loop.now:
            return
        ids, owners, marks, released = redis.keys[:4]
        client = redis.backend.client(node.db)
        held = sorted(int(k) for k in client.hkeys(owners))
        if not held:
            return
        worker = self.rng.choice(held)
        kind = self.rng.choice(("expiry0", "mark0", "expiry0+mark0", "mark_deleted", "owner_deleted", "released"))
        if "expiry0" in kind:
            client.zadd(ids, {str(worker): 0})
        if "mark0" in kind:
            client.hset(marks, str(worker), 0)
        if kind == "mark_deleted":
            client.hdel(marks, str(worker))
        if kind == "owner_deleted":
            client.hdel(owners, str(worker))
        if kind == "released":
            client.hset(released, str(worker), 1)
        redis._written(node)
        self._event("damage", f"worker id {worker}: {kind}")

    def rollback(self) -> None:
        """Redis's data rolled back in place (issue 32): the master's data set replaced by an older one
        without a restart (``DEBUG RELOAD`` of an older RDB, ``FLUSHALL`` + ``RESTORE`` of a backup), so its
        run_id and replid stay, and its clients' connections and subscriptions survive. Replicated (a
        RESTORE is), as the master's next write. Held, unless --known-gaps, when it would undo a clean
        release made less than 2 x the clock skew max ago: the next holder then starts above the older
        mark only, and uniqueness rests on its clock being behind the releaser's by less than the time
        since the release (docs/leasing.md); and, as a restart that loses data is, while a clock is off."""
        redis, rng, ttl = self.sim.redis, self.rng, self.sim.config.ttl
        node = redis.master
        if node is None or not node.up or node.paused_until > redis.loop.now:
            return
        age = rng.choice((rng.uniform(0.01, 1.0), rng.uniform(1.0, ttl), rng.uniform(ttl, 3 * ttl)))
        now = redis.loop.now
        recent = now - redis.last_clean_release < 2 * self.sim.config.skew_max
        if not self.sim.known_gaps and recent and redis.last_clean_release > now - age:
            self.sim.stats["rollback held: it would undo a release made within 2 x skew"] += 1
            return
        if self.sim.loss_held("rollback"):
            return
        redis.write(node, redis.state_at(node, now - age))
        redis._written(node)
        self._event("rollback", f"{node.name} to its data {age:.3f}s ago (run_id and replid unchanged)")

    # -- the network ---------------------------------------------------------------------------------
    def net(self) -> None:
        process = self._process()
        if process is None:
            return
        length = self._outage(1.0)
        process.net_down_until = max(process.net_down_until, self.sim.loop.now + length)
        self._busy(length)
        self._event("net", f"{process.name} cut off from Redis for {length:.3f}s")

    def lost_replies(self) -> None:
        redis = self.sim.redis
        redis.lost_reply_rate = self.rng.uniform(0.05, 0.5)
        redis.lost_request_rate = self.rng.uniform(0.0, 0.2)
        redis.slow_rate = self.rng.uniform(0.0, 0.3)
        length = self.rng.uniform(0.5, 3 * self.sim.config.ttl)
        self._event(
            "lost_replies", f"{redis.lost_reply_rate:.0%} of replies lost, {redis.slow_rate:.0%} late, {length:.3f}s"
        )

        def end() -> None:
            redis.lost_reply_rate = redis.lost_request_rate = redis.slow_rate = 0.0

        self._later(length, end)
