"""The in-memory control store keeps the scripts' rules (the Redis store's own are tested
against a real Redis in tests/): leases, ownership with fencing epochs, and a received
update's statuses."""

from __future__ import annotations

import asyncio

from synchronizer.store.control import Commit, ControlStore
from synchronizer.store.memory_store import MemoryControlStore


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000.0

    def __call__(self) -> float:
        return self.ms


def test_a_slot_holds_one_session_until_its_lease_lapses_and_a_newer_incarnation_wins() -> None:
    clock = Clock()
    store: ControlStore = MemoryControlStore("job", clock)

    async def run() -> None:
        first = await store.hello("[]", "a", "i1", 1.0, 5, False)
        assert (first.status, first.initializer) == ("ok", True)  # the job has no values yet
        assert (await store.hello("[]", "a", "i2", 1.0, 0, False)).status == "busy"
        assert (await store.hello("[1]", "b", "j", 1.0, 0, False)).status == "spec_mismatch"
        assert await store.heartbeat("a", "i1", first.session, 1.0, 7, ema=0.5, last_sent=0.0) == 7
        live = await store.live()
        assert [(lv.learner, lv.step_time_ema_s) for lv in live.learners] == [("a", 0.5)]
        clock.ms += 2_000  # the lease lapses
        assert not await store.is_live("a")
        again = await store.hello("[]", "a", "i2", 1.0, 3, True)
        assert (again.status, again.previous, again.counted_steps) == ("ok", "i1", 3)
        assert await store.heartbeat("a", "i1", first.session, 1.0, 9) is None  # superseded
        assert await store.incarnation("a") == ("i2", 2)

    asyncio.run(run())


def test_ownership_is_fenced_by_epoch_and_a_commit_only_lands_on_its_version() -> None:
    clock = Clock()
    store: ControlStore = MemoryControlStore("job", clock)

    async def run() -> None:
        assert await store.own("acquire", 0, "r1", ttl_s=1.0) == ("owned", 1)
        assert await store.own("acquire", 0, "r2", ttl_s=1.0) == ("taken", 1)
        assert await store.init_fragment(0, "v0", ("s0",))
        assert not await store.init_fragment(0, "other", ())
        assert (await store.hello("[]", "a", "i", 60.0, 0, True)).status == "ok"
        received = await store.receive(
            0, "r1", 1, learner="a", incarnation="i", seq=1, checksum=7, base_version=0,
            max_staleness=2, record={}, generation=1, norm=(2.0, 10),
        )  # fmt: skip
        assert received == ("received", 0)
        assert await store.norms(0) == {"a": (2.0, 10)}
        commit = Commit(0, "r1", 1, 0, "v0", ("s0",), "d1", [("a", "i", 1)], 1.0, 100.0, 0, {})
        clock.ms += 2_000  # r1's lease lapses: r2 takes the fragment at epoch 2
        assert await store.own("acquire", 0, "r2", ttl_s=1.0) == ("owned", 2)
        assert await store.commit(commit) == ("lost_lease", 0)
        assert await store.pending(1) == []  # the round died with its owner
        resent = Commit(0, "r2", 2, 0, "v0", ("s0",), "d1", [("a", "i", 1)], 1.0, 100.0, 0, {})
        again = await store.receive(
            0, "r2", 2, learner="a", incarnation="i", seq=1, checksum=7, base_version=0,
            max_staleness=2, record={},
        )  # fmt: skip
        assert again == ("received", 0)
        assert await store.commit(resent) == ("committed", 1)
        assert await store.commit(resent) == ("version_moved", 1)
        duplicate = await store.receive(
            0, "r2", 2, learner="a", incarnation="i", seq=1, checksum=7, base_version=0,
            max_staleness=2, record={},
        )  # fmt: skip
        assert duplicate == ("duplicate", 1)

    asyncio.run(run())
