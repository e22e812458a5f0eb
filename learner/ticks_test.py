"""The ticks of a learner of several processes, over an in-memory key-value store: every
process applies the leader's decision, and only it."""

from __future__ import annotations

import json
import threading

import numpy as np

from learner.client import RangeValues, SynchronizerClient
from learner.group import Group
from learner.ticks import Ticks
from services.gen.atoll.v1 import session_pb2


class Store:
    """The coordination service's key-value store, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = False) -> None:
        self.values[key] = value

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        return self.values[key]

    def key_value_delete(self, key: str) -> None:
        for k in [k for k in self.values if k == key or k.startswith(key + "/")]:
            del self.values[k]


def client() -> SynchronizerClient:
    """A process's client, never connected: told versions, as a learner of several's is."""
    return SynchronizerClient(
        ["127.0.0.1:1"], job="j", learner_id="two", incarnation="i", params=[], version_notices=True
    )


def test_a_follower_applies_the_leaders_acks_owners_budget_and_stop() -> None:
    store = Store()
    leader_client, follower_client = client(), client()
    stop = threading.Event()
    leader = Ticks(Group(0, 2, store), leader_client, stop, threading.Event())
    follower = Ticks(Group(1, 2, store), follower_client, threading.Event(), threading.Event())
    for c in (leader_client, follower_client):  # the update every process sent as seq 1
        c.send_initial(0, np.zeros(2, np.float32))
    owner = session_pb2.FragmentOwner(fragment=0, replica="r", address="a:1", epoch=2)
    leader_client.set_owners([owner])
    leader_client.settle(session_pb2.Ack(seq=1, status=session_pb2.ACK_STATUS_COMMITTED))
    leader_client.session.job_status = session_pb2.JobStatus(finish=True)
    stop.set()
    verdicts = [leader.tick(), follower.tick()]
    assert [v.halt for v in verdicts] == [False, False]
    for ticks, c in ((leader, leader_client), (follower, follower_client)):
        assert ticks.final[1].status == session_pb2.ACK_STATUS_COMMITTED
        assert ticks.finished
        assert ticks.stopping.is_set()
        assert c.unacked() == 0
        assert c.owners[0].epoch == 2
    # Told once: the next tick relays neither the ack nor the map again.
    leader.tick(halt=True)
    assert follower.tick().halt
    told = json.loads(store.values["atoll/tick/0/1"])
    assert (told["acks"], told["owners"], told["halt"]) == ([], None, True)


def test_a_version_is_handed_over_at_the_tick_that_names_it_in_order() -> None:
    store = Store()
    leader_client = client()
    leader = Ticks(Group(0, 2, store), leader_client, threading.Event(), threading.Event())
    fetched: list[tuple[int, int]] = []

    def fetch(p: int, version: int, closed: threading.Event) -> RangeValues:
        fetched.append((p, version))
        return RangeValues(p, version, np.full(1, version, np.float32), checksum=version)

    leader.follow(fetch)
    try:
        leader_client.held.notice(1, 5)
        leader_client.held.notice(0, 3)
        events = []
        for _ in range(100):  # the versions thread fetches them in the background
            events += leader.tick(wait=0.05).events
            if len(events) == 2:
                break
        assert [(e.fragment, e.version) for e in events] == [(1, 5), (0, 3)]
        assert fetched == [(1, 5), (0, 3)]
        assert store.values["atoll/event/0"] == b"[1, 5]"
    finally:
        leader.close()
