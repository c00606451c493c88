"""The real half of the simulator's Redis: the lease scripts, rewritten in their three reads of Redis's own
clock and identity, loaded into a real redis-server.

Every lease script the daemons send runs, as written in ``katsubushi_py/leasing/scripts.py``, in a real
redis-server (one database per simulated node), so every record check, quarantine and doubt window is
Redis's own Lua and Redis's own data structures. The scripts read their environment in exactly five
places, ``redis.call('TIME')``, ``redis.call('INFO', 'server')``, ``redis.call('INFO',
'replication')`` and the two counts of a holder channel's subscribers (``PUBSUB NUMSUB`` and
``SHARDNUMSUB``); :func:`simulated` replaces those calls (and nothing else: tests/test_sim_leasing.py
checks it) by reads of a hash the simulator writes before each script, holding the node's simulated
clock, the backend's real INFO text with the node's simulated ``run_id``, ``master_replid``,
``master_replid2`` (and ``second_repl_offset``) and ``connected_slaves``, and the simulated clients'
subscriptions on that node (``sub:<channel>``; the simulated clients subscribe the classic way, so the
sharded count is 0). The rest of each script is byte for byte the production one.

A module of its own because it is the one part of the simulated Redis that is not a model: what it
rewrites is what tests/test_sim_leasing.py checks, and it needs neither the virtual loop nor the world.
What Redis does around the scripts (clocks, identities, replicas, restarts, failovers, the network) is
modelled in sim_redis.py; the daemons' redis-py side of the connection is sim_redis_client.py.
"""

from __future__ import annotations

import re

import redis

from katsubushi_py.leasing import scripts as lease_scripts

SCRIPT_NAMES = (
    "INIT_LUA",
    "ACQUIRE_LUA",
    "RENEW_LUA",
    "RELEASE_LUA",
    "IDENTITY_LUA",
    "REPLICAS_LUA",
    "ACQUIRE_COUNTED_LUA",
    "RENEW_COUNTED_LUA",
)
ENV_KEY = "sim:env"
# The scripts' only reads of their environment, and what the simulation reads instead.
SUBSTITUTIONS = (
    ("redis.call('TIME')", f"redis.call('HMGET', '{ENV_KEY}', 's', 'us')"),
    ("redis.call('INFO', 'server')", f"redis.call('HGET', '{ENV_KEY}', 'server')"),
    ("redis.call('INFO', 'replication')", f"redis.call('HGET', '{ENV_KEY}', 'replication')"),
    ("redis.call('PUBSUB', 'NUMSUB', channel)[2]", f"(redis.call('HGET', '{ENV_KEY}', 'sub:' .. channel) or 0)"),
    ("pcall(redis.call, 'PUBSUB', 'SHARDNUMSUB', channel)", "false, nil"),
)


def simulated(script: str) -> str:
    """The script with its reads of Redis's clock and identity replaced by reads of the simulated ones."""
    out = script
    for real, sim in SUBSTITUTIONS:
        out = out.replace(real, sim)
    leftover = re.findall(r"redis\.call\('(TIME|INFO|PUBSUB)'|redis\.call, 'PUBSUB'", out)
    if leftover:
        raise AssertionError(f"the script reads {leftover} in a way the simulation does not replace")
    return out


class Backend:
    """The real redis-server the scripts run in (a unix socket): one database per simulated node."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._clients: dict[int, redis.Redis] = {}
        self.sha: dict[str, str] = {}
        first = self.client(0)
        for name in SCRIPT_NAMES:
            text = getattr(lease_scripts, name)
            self.sha[text] = first.script_load(simulated(text))
        # The INFO sections as this redis-server writes them: a simulated node's differ only in the values
        # the simulation controls.
        self.info_server = first.eval("return redis.call('INFO', 'server')", 0).decode()
        self.info_replication = first.eval("return redis.call('INFO', 'replication')", 0).decode()
        for pattern in (
            r"\brun_id:[0-9a-f]+",
            r"\bmaster_replid:[0-9a-f]+",
            r"\bmaster_replid2:[0-9a-f]+",
            r"\bsecond_repl_offset:-?\d+",
            r"\bconnected_slaves:\d+",
        ):
            if not re.search(pattern, self.info_server + self.info_replication):
                raise AssertionError(f"redis-server's INFO has no {pattern}")

    def client(self, db: int) -> redis.Redis:
        client = self._clients.get(db)
        if client is None:
            client = self._clients[db] = redis.Redis(unix_socket_path=self.socket_path, db=db, socket_timeout=30)
        return client

    def info(self, run_id: str, replid: str, replicas: int, replid2: str = "0" * 40) -> tuple[str, str]:
        server = re.sub(r"\brun_id:[0-9a-f]+", f"run_id:{run_id}", self.info_server)
        replication = re.sub(r"\bmaster_replid:[0-9a-f]+", f"master_replid:{replid}", self.info_replication)
        replication = re.sub(r"\bmaster_replid2:[0-9a-f]+", f"master_replid2:{replid2}", replication)
        second = "-1" if replid2 == "0" * 40 else "1"
        replication = re.sub(r"\bsecond_repl_offset:-?\d+", f"second_repl_offset:{second}", replication)
        replication = re.sub(r"\bconnected_slaves:\d+", f"connected_slaves:{replicas}", replication)
        return server, replication

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
