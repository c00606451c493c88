"""Redis Cluster failover under load (issue 24): three masters with a replica each
(``--cluster-node-timeout 1000``), three leasing daemons given a ``rediscluster://`` URL, steady GET
load with every ID recorded. The master that owns the namespace's slot is SIGKILLed and the cluster
promotes its replica (measured: about 2.5 s): no duplicate, no failed request, every daemon follows
the new master. Once with another node in the URL, once with that very master as the only seed: a
failed renew rediscovers the cluster through every node it has learned of, not only the URL's.

Timings as in test_ha_sentinel.py: ttl 9 s, renew 1 s leave 7.1 s for the failover.

The two tests share one cluster (built once, about 2 s), each with its own namespace on a master that
still has its replica.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from conftest import Daemon, DaemonFactory
from id_recorder import Recorder
from lease_helpers import init_pool, stats, wait_serving, wait_until
from redis_servers import ClusterSetup, RedisServer, start_cluster

pytestmark = pytest.mark.once

RENEW = 1.0
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


def address(server: RedisServer) -> str:
    return f"127.0.0.1:{server.port}"


def fail_over_under_load(daemons: DaemonFactory, cluster: ClusterSetup, seed_is_the_master: bool) -> None:
    ns, master, replica = namespace_on_a_master_with_a_replica(cluster)
    seed = master if seed_is_the_master else next(n for n in cluster.alive() if n not in (master, replica))
    url = cluster.url(seed)
    init_pool(url, ns, 1, 4)
    loaded: list[Daemon] = []
    for _ in range(3):
        d = daemons.start("--redis", f"{url}?ns={ns}", *ARGS, *SKEW, worker_id=None)
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
            lambda: all(stats(d)["lease_redis_address"] == address(replica) for d in loaded),
            timeout=RENEW * 3 + 5,
            step=0.1,
        )
        time.sleep(1)
    finally:
        recorder.stop()
    assert recorder.duplicates() == 0, recorder.summary()
    assert recorder.overlapping_holders() == []
    assert [r.error for r in recorder.replies if r.error] == []  # no client request failed
    fields = [stats(d) for d in loaded]
    gaps = [int(f["lease_longest_renew_gap_ms"]) / 1000 for f in fields]
    served_after = [len(recorder.served(d, killed + failover)) for d in range(3)]
    print(
        f"Cluster failover, {'the dying master as the only seed' if seed_is_the_master else 'another node as seed'}:"
        f" {recorder.summary()}; failover {failover:.2f} s; longest time without a confirmed renew per daemon"
        f" {gaps} s; replies after the promotion {served_after}"
    )
    assert all(served_after)
    assert max(gaps) <= failover + RENEW + 1.5, gaps
    for d, f in zip(loaded, fields, strict=True):
        assert f["lease_master_changes"] == "1" and f["worker_id_changes"] == "0", f
        assert f["lease_kept_through_change"] == "1" and f["lease_data_loss_events"] == "0", f
        assert f"changed: {address(master)} -> {address(replica)}; following it" in d.stderr()


def test_cluster_failover_with_another_node_in_the_url(daemons: DaemonFactory, cluster: ClusterSetup) -> None:
    fail_over_under_load(daemons, cluster, seed_is_the_master=False)


def test_cluster_failover_with_the_dying_master_as_the_only_seed(daemons: DaemonFactory, cluster: ClusterSetup) -> None:
    """Before, the daemons never renewed again ("Redis Cluster cannot be connected"): a failed renew
    rediscovered the cluster from the URL's one node, the dead master."""
    fail_over_under_load(daemons, cluster, seed_is_the_master=True)
