"""Redis Cluster failover under load (issue 24): three masters with a replica each
(``--cluster-node-timeout 1000``), three leasing daemons given a ``rediscluster://`` URL, steady GET
load with every ID recorded. The master that owns the namespace's slot is SIGKILLed and the cluster
promotes its replica (measured: about 2.5 s): no duplicate, no failed request, every daemon follows
the new master. Once with another node in the URL, once with that very master as the only seed: a
failed renew rediscovers the cluster through every node it has learned of, not only the URL's.

Timings as in test_ha_sentinel.py: ttl 9 s, renew 1 s leave 7.1 s for the failover. The masters keep
``min-replicas-to-write 0`` (a promoted replica has no replica of its own here, and would refuse every
write with 1), so the URL says ``allow=no-min-replicas`` and each lease write waits for every replica
the master has had (issue 32's fallback rule).

The two tests share one cluster (built once, about 2 s), each with its own namespace on a master that
still has its replica.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from conftest import Daemon, DaemonFactory
from id_recorder import Recorder
from lease_helpers import RENEW_HA, check_followed_without_a_failed_request, init_pool, stats, wait_serving, wait_until
from redis_servers import ClusterSetup, RedisServer, start_cluster

pytestmark = pytest.mark.once

RENEW = RENEW_HA
ARGS = ("--lease-ttl", "9s", "--lease-renew", "1s", "--lease-delay", "2s")
SKEW = ("--clock-skew-max", "0.5s", "--clock-skew-warn", "0.5s")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterSetup]:
    setup = start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield setup
    finally:
        setup.stop()


def namespace_on_a_master_with_a_replica(cluster: ClusterSetup) -> tuple[str, RedisServer, RedisServer]:
    """A namespace whose slot's master is alive and has a live replica (the other test may have killed
    one master already)."""
    for n in range(1000):
        ns = f"ha{n}"
        master, replicas = cluster.slot_nodes("{" + ns + "}:ids")
        alive = [r for r in replicas if r.proc.poll() is None]
        if master.proc.poll() is None and alive:
            return ns, master, alive[0]
    raise RuntimeError("no master with a replica left")


def fail_over_under_load(daemons: DaemonFactory, cluster: ClusterSetup, seed_is_the_master: bool) -> None:
    ns, master, replica = namespace_on_a_master_with_a_replica(cluster)
    seed = master if seed_is_the_master else next(n for n in cluster.alive() if n not in (master, replica))
    url = cluster.url(seed)
    init_pool(url, ns, 1, 4)
    loaded: list[Daemon] = []
    for _ in range(3):
        d = daemons.start("--redis", f"{url}?ns={ns}&allow=no-min-replicas", *ARGS, *SKEW, worker_id=None)
        wait_serving(d)
        loaded.append(d)
    assert all(stats(d)["lease_replicas_expected"] == "1" for d in loaded)
    recorder = Recorder(loaded).start()
    try:
        time.sleep(1.5)
        killed = time.monotonic()
        master.stop()
        wait_until(lambda: cluster.slot_nodes("{" + ns + "}:ids")[0] is replica, timeout=30, step=0.02)
        failover = time.monotonic() - killed
        wait_until(
            lambda: all(stats(d)["lease_redis_address"] == replica.address for d in loaded),
            timeout=RENEW * 3 + 5,
            step=0.1,
        )
        time.sleep(1)
    finally:
        recorder.stop()
    what = f"Cluster failover, {'the dying master as the only seed' if seed_is_the_master else 'another node as seed'}"
    check_followed_without_a_failed_request(recorder, loaded, killed, failover, master.address, replica.address, what)


def test_cluster_failover_with_another_node_in_the_url(daemons: DaemonFactory, cluster: ClusterSetup) -> None:
    fail_over_under_load(daemons, cluster, seed_is_the_master=False)


def test_cluster_failover_with_the_dying_master_as_the_only_seed(daemons: DaemonFactory, cluster: ClusterSetup) -> None:
    """Before, the daemons never renewed again ("Redis Cluster cannot be connected"): a failed renew
    rediscovered the cluster from the URL's one node, the dead master."""
    fail_over_under_load(daemons, cluster, seed_is_the_master=True)
