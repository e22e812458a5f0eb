"""The synchronizer on a real three-node Redis Cluster: fragments' keys land on different
nodes (each fragment's keys share one hash tag, no script spans two), and rounds commit."""

from __future__ import annotations

from pathlib import Path

import redis
import redis.cluster

from cluster.processes import synchronizer_child
from cluster.redis_server import RedisClusterServers
from synchronizer.store.keys import JobKeys
from tests import support
from tests.test_synchronizer import wait_until

P = 5


def test_fragments_spread_over_the_nodes_of_a_redis_cluster_and_commit(tmp_path: Path) -> None:
    with RedisClusterServers(tmp_path / "redis") as nodes:
        sync = synchronizer_child(
            tmp_path, nodes.url, "sync-0", ["--fragments", str(P), "--grace-seconds", "0"]
        ).start_and_wait()
        c = support.client([sync.address], "l0")
        r = redis.cluster.RedisCluster(host="127.0.0.1", port=nodes.servers[0].port)
        keys = JobKeys("default")
        try:
            support.initialize(c, P)
            for p in range(P):
                c.wait_ack(support.send_delta(c, p, P, 0, seed=p), 30, received=True)
            wait_until(
                lambda: all(int(r.hget(keys.frag(p), "version") or 0) >= 1 for p in range(P)),
                timeout=30,
                what="every fragment to commit on the cluster",
            )
            # Each fragment's keys live where its hash tag puts them: on more than one node.
            homes = set()
            for p in range(P):
                slot = r.keyslot(keys.frag(p))
                assert r.keyslot(keys.round(p)) == slot == r.keyslot(keys.owner(p))
                homes.add(r.nodes_manager.get_node_from_slot(slot).port)
            assert len(homes) >= 2, homes
            assert r.keyslot(keys.learners) == r.keyslot(keys.spec)  # job-wide keys together
        finally:
            c.close()
            sync.stop()
            r.close()
