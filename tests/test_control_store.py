"""The control store's two backends, one set of tests: the Redis store (its Lua scripts, on
a real redis-server) and the in-memory one the synchronizer's unit tests run on answer
every call alike."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from cluster.redis_server import RedisServer
from synchronizer.store.control import Commit, ControlStore, SessionReopened
from synchronizer.store.memory_store import MemoryControlStore
from synchronizer.store.redis_store import open_store

Scenario = Callable[[ControlStore], Coroutine[Any, Any, None]]


@pytest.fixture(params=["memory", "redis"])
def run(request: pytest.FixtureRequest) -> Callable[[Scenario], None]:
    """Run a scenario against a fresh job on the backend of this parameter."""
    redis_server: RedisServer | None = None
    if request.param == "redis":
        redis_server = request.getfixturevalue("redis_server")

    def go(scenario: Scenario) -> None:
        async def main() -> None:
            if redis_server is None:
                await scenario(MemoryControlStore("job"))
                return
            store = open_store(redis_server.url, "job")
            try:
                await scenario(store)
            finally:
                await store.close()

        asyncio.run(main())

    return go


async def beat(
    store: ControlStore,
    learner: str,
    incarnation: str,
    session: int,
    counted: int,
    still_to_send: list[int] | None = None,
    ema: float = 0.0,
    last_sent: float = 0.0,
) -> int | None:
    """A heartbeat, every field as a session sends it."""
    return await store.heartbeat(
        learner,
        incarnation,
        session,
        60.0,
        counted,
        still_to_send,
        step=float(counted),
        ema=ema,
        tokens_s=0.0,
        loss=-1.0,
        eval_loss=-1.0,
        done=0.0,
        last_sent=last_sent,
    )


async def receive(
    store: ControlStore,
    replica: str,
    epoch: int,
    seq: int,
    *,
    checksum: int = 7,
    base_version: int = 0,
    generation: int | None = None,
    norm: tuple[float, int] | None = None,
) -> tuple[str, int]:
    """Slot "a" (incarnation "i") records update `seq` of fragment 0."""
    return await store.receive(
        0,
        replica,
        epoch,
        learner="a",
        incarnation="i",
        seq=seq,
        checksum=checksum,
        base_version=base_version,
        max_staleness=2,
        record={},
        generation=generation,
        norm=norm,
    )


def test_sessions_leases_and_the_step_budget(run: Callable[[Scenario], None]) -> None:
    async def scenario(store: ControlStore) -> None:
        first = await store.hello("[]", "a", "i1", 60.0, 5, False)
        assert (first.status, first.previous, first.initializer) == ("ok", "", True)
        assert (first.counted_steps, first.steps_done) == (0, 0)
        assert (await store.hello("[]", "a", "i2", 60.0, 0, False)).status == "busy"
        assert (await store.hello("[1]", "b", "j", 60.0, 0, False)).status == "spec_mismatch"
        second = await store.hello("[]", "b", "j", 60.0, 0, False)
        assert (second.status, second.initializer) == ("ok", False)  # a holds the claim
        assert await beat(store, "a", "i1", first.session, 7, ema=0.5) == 7
        assert await beat(store, "b", "j", second.session, 3, [2], last_sent=1.0) == 10
        live = {lv.learner: lv for lv in (await store.live()).learners}
        assert (live["a"].step_time_ema_s, live["a"].finished, live["a"].still_to_send) == (
            0.5,
            False,
            None,
        )
        assert (live["b"].finished, live["b"].still_to_send) == (True, frozenset({2}))
        await store.leave("a", "stale", first.session)  # not its incarnation: nothing
        assert await store.is_live("a")
        # The same incarnation again while its lease runs: it reconnected; a new session.
        reopened = await store.hello("[]", "a", "i1", 60.0, 7, True)
        assert (reopened.status, reopened.session) == ("ok", first.session + 1)
        with pytest.raises(SessionReopened):
            await beat(store, "a", "i1", first.session, 8)
        await store.leave("a", "i1", first.session)  # the old session's: nothing
        assert await store.is_live("a")
        await store.leave("a", "i1", reopened.session)
        assert not await store.is_live("a")
        again = await store.hello("[]", "a", "i2", 60.0, 4, True)
        assert (again.status, again.previous, again.counted_steps, again.steps_done) == (
            "ok",
            "i1",
            4,
            7,
        )
        assert await beat(store, "a", "i1", reopened.session, 9) is None  # superseded
        assert await store.incarnation("a") == ("i2", 3)
        assert await store.incarnation("nobody") is None
        assert await store.spec() == "[]"
        assert await store.register_spec("[2]") == "[]"

    run(scenario)


def test_ownership_updates_and_commits(run: Callable[[Scenario], None]) -> None:
    async def scenario(store: ControlStore) -> None:
        assert await store.register("r1", "host:1", 60.0) == {"r1": "host:1"}
        assert await store.own("acquire", 0, "r1", ttl_s=60.0) == ("owned", 1)
        assert await store.own("acquire", 0, "r2", ttl_s=60.0) == ("taken", 1)
        assert await store.own("renew", 0, "r2", 1, 60.0) == ("lost", 0)
        assert await store.owners(2) == [("r1", 1), None]
        assert await store.versions(1) == [None]
        assert await receive(store, "r1", 1, 1) == (
            "uninitialized",
            0,
        )
        assert await store.init_fragment(0, "v0", ("s0",))
        assert not await store.init_fragment(0, "other", ())
        assert await store.is_initialized(1)
        assert (await store.hello("[]", "a", "i", 60.0, 0, True)).status == "ok"
        assert await receive(store, "r1", 1, 1) == (
            "new_incarnation",
            0,
        )
        assert await receive(store, "r1", 1, 1, generation=1, norm=(2.0, 10)) == ("received", 0)
        assert await receive(store, "r1", 1, 1) == (
            "again",
            0,
        )
        assert await receive(store, "r1", 1, 1, checksum=8) == (
            "checksum",
            0,
        )
        assert await receive(store, "r1", 1, 2, base_version=3) == (
            "future",
            0,
        )
        assert await receive(store, "r2", 1, 2) == (
            "not_owner",
            0,
        )
        assert await store.norms(0) == {"a": (2.0, 10)}
        assert await store.pending(1) == ["a/i/1"]
        entry = {"version": 1, "uids": ["a/i/1"]}
        commit = Commit(0, "r1", 1, 0, "v0", ("s0",), "d1", [("a", "i", 1)], 1.5, 10.0, 0, entry)
        assert await store.commit(dataclasses.replace(commit, epoch=2)) == ("lost_lease", 0)
        assert await store.commit(commit) == ("committed", 1)
        assert await store.commit(commit) == ("version_moved", 1)
        assert await receive(store, "r1", 1, 1) == (
            "duplicate",
            1,
        )
        pointer = await store.pointer(0)
        assert pointer is not None
        assert (pointer.version, pointer.value, pointer.state, pointer.delta) == (
            1,
            "v0",
            ("s0",),
            "d1",
        )
        assert await store.log_range(0, 0, 1) == [entry]
        assert await store.pending(1) == []
        await store.add_stats(bytes_up=100.0, updates_rejected=0.0)
        stats = await store.stats(1)
        assert stats["bytes_up"] == 100.0
        assert "updates_rejected" not in stats
        assert (stats["updates_accepted"], stats["versions_committed"]) == (1.0, 1.0)
        assert (stats["useful_seconds"], stats["tokens_merged"]) == (1.5, 10.0)
        # Given back, taken by another replica at a higher epoch: the open round is void.
        assert await receive(store, "r1", 1, 3) == (
            "received",
            1,
        )
        assert await store.own("release", 0, "r1", 1) == ("owned", 1)
        assert await store.own("acquire", 0, "r2", ttl_s=60.0) == ("owned", 2)
        assert await store.pending(1) == []
        assert await store.register("r1", "host:1", 0) == {}

    run(scenario)
