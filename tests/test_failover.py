"""Two synchronizer replicas on one Redis; one is SIGKILLed mid-run. A learner with no
synchronizer to talk to waits for one (by default for as long as it lives)."""

from __future__ import annotations

import signal
import threading
import time
import uuid

import pytest
import redis

from cluster.redis_server import RedisServer, free_port
from learner.client import SessionError, SynchronizerClient
from services.gen.atoll.v1 import session_pb2
from synchronizer import inspect
from tests import support
from tests.conftest import SpawnSynchronizer

FRAGMENTS = 2
UPDATES_PER_CLIENT = 24
KILL_AFTER = 8


def drive(
    c: SynchronizerClient,
    index: int,
    acked: list[str],
    started: threading.Event,
    refused: list[str],
) -> None:
    versions = {p: 0 for p in range(FRAGMENTS)}
    for i in range(UPDATES_PER_CLIENT):
        while not c.fragments.empty():
            g = c.fragments.get_nowait()
            versions[g.fragment] = max(versions[g.fragment], g.version)
        p = (i + index) % FRAGMENTS
        seq = support.send_delta(c, p, FRAGMENTS, versions[p], seed=1000 * index + i)
        ack = c.wait_ack(seq, 60, received=True)
        if ack.status in (session_pb2.ACK_STATUS_RECEIVED, session_pb2.ACK_STATUS_COMMITTED):
            acked.append(f"{c.learner_id}/{c.incarnation}/{seq}")
        else:
            refused.append(ack.reason)
        if i == KILL_AFTER:
            started.set()
        time.sleep(0.02)


def test_a_replica_killed_mid_run_loses_nothing_and_commits_each_round_once(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    # These clients update faster than rounds merge, and the ones on the killed replica only
    # learn new versions after they reconnect: staleness is not what this test is about.
    args = ("--fragments", str(FRAGMENTS), "--grace-seconds", "0.05", "--max-staleness", "1000")
    a = spawn_synchronizer(*args, replica="sync-a")
    b = spawn_synchronizer(*args, replica="sync-b")
    clients = [
        support.client([a.address, b.address] if i < 2 else [b.address, a.address], f"l{i}")
        for i in range(4)
    ]
    support.initialize(clients[0], FRAGMENTS)
    acked: list[list[str]] = [[] for _ in clients]
    marks = [threading.Event() for _ in clients]
    refused: list[str] = []
    threads = [
        threading.Thread(target=drive, args=(c, i, acked[i], marks[i], refused), daemon=True)
        for i, c in enumerate(clients)
    ]
    for t in threads:
        t.start()
    for m in marks:
        assert m.wait(60)
    a.signal(signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()

    r = redis.Redis(port=redis_server.port)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(c.unacked() for c in clients):
        time.sleep(0.1)
    merged: list[str] = []
    for p in range(FRAGMENTS):
        log = support.commit_log(r, p)
        assert [e["version"] for e in log] == list(range(1, len(log) + 1)), "versions consecutive"
        assert support.version(r, p) == len(log), "each round committed once"
        merged += [u for e in log for u in e["uids"]]  # type: ignore[attr-defined]
    all_acked = [u for batch in acked for u in batch]
    assert len(all_acked) == 4 * UPDATES_PER_CLIENT, f"refused: {refused}"
    assert len(merged) == len(set(merged)), "no update applied twice"
    assert support.pending(r, FRAGMENTS) == [], "updates still pending"
    assert sorted(merged) == sorted(all_acked), "every acknowledged update merged, exactly once"
    assert all(c.unacked() == 0 for c in clients), [
        [
            (
                o.seq,
                o.fragment,
                o.received_epoch,
                f"{c.learner_id}/{c.incarnation}/{o.seq}" in merged,
            )
            for o in c.ingest.kept()
        ]
        for c in clients
    ]
    assert clients[0].stats.reconnects >= 1
    assert clients[1].stats.reconnects >= 1
    assert clients[2].stats.reconnects == 0
    # The learners whose session never broke hold every fragment's last version, the killed
    # replica's ones too: its fragments' new owner pushed them (they follow every owner).
    final = {p: support.version(r, p) for p in range(FRAGMENTS)}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        c.held.versions().get(p, -1) != v for c in clients[2:] for p, v in final.items()
    ):
        time.sleep(0.1)
    assert [{p: c.held.versions().get(p, -1) for p in final} for c in clients[2:]] == [final] * 2
    for c in clients:
        c.close()


def test_a_learner_waits_for_the_synchronizer_tier_however_long_it_is_away(
    spawn_synchronizer: SpawnSynchronizer,
) -> None:
    # Nothing listens yet: by default the client keeps retrying (no deadline) and joins the
    # replica that comes up later where it looks for it.
    port = free_port()
    waiting = SynchronizerClient(
        [f"127.0.0.1:{port}"],
        job="default",
        learner_id="l0",
        incarnation=uuid.uuid4().hex,
        params=support.SPECS,
        max_backoff_s=0.5,
    )
    welcomed: list[session_pb2.Welcome] = []
    thread = threading.Thread(target=lambda: welcomed.append(waiting.connect()), daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert thread.is_alive(), "the client gave up"  # still waiting
    assert not welcomed
    spawn_synchronizer("--fragments", str(FRAGMENTS), port=port)
    thread.join(timeout=60)
    assert welcomed, "no welcome once a replica came up"
    assert welcomed[0].config.fragments == FRAGMENTS
    waiting.close()

    # --give-up-s: a finite wait for those who want one; a stop request ends the wait too.
    nowhere = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(SessionError, match="no synchronizer answered for 1 s"):
        support.client([nowhere], "l1", give_up_s=1.0)
    assert time.monotonic() - started < 10
    stop = threading.Event()
    stopping = SynchronizerClient(
        [nowhere], job="default", learner_id="l2", incarnation="i", params=support.SPECS
    )
    threading.Timer(1.0, stop.set).start()
    with pytest.raises(SessionError, match="stopped"):
        stopping.connect(stop)


def test_updates_whose_round_died_with_its_owner_are_found(redis_server: RedisServer) -> None:
    # What `atoll up`'s report reads to tell an update dropped with its round (received
    # under an owner epoch that has ended, never received again) from one lost.
    r = redis.Redis(port=redis_server.port)
    keys = support.KEYS
    r.set(keys.epoch(0), 3)
    # A slot's records of a fragment name their incarnation and its hello's generation.
    held = {"incarnation": "inc", "generation": "1"}
    r.hset(keys.seen(0, "l:0"), mapping={**held, "1": "2 c1 r", "2": "3 c2 r", "3": "1 c3 c"})
    r.hset(keys.seen(1, "l1"), mapping={**held, "1": "1 c4 r"})  # fragment 1: epoch 0
    assert inspect.dropped(r, "default", 2) == ["l:0/inc/1"]
