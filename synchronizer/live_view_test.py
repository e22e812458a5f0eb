"""The shared view of the live learners: one read for many callers within its age, a read
again for a learner it lacks (once, even for one that is gone), and the store's errors."""

from __future__ import annotations

import asyncio

import pytest

from synchronizer.core.rounds import Live
from synchronizer.live_view import LiveView
from synchronizer.store.control import StoreError
from synchronizer.store.memory_store import MemoryControlStore


class Clock:
    def __init__(self) -> None:
        self.s = 100.0

    def __call__(self) -> float:
        return self.s


class CountedStore:
    """The in-memory store's live learners, each read counted; `gate` (when set) holds the
    answer back after the store gave it (`answered`), `fail` makes the reads fail."""

    def __init__(self) -> None:
        self.store = MemoryControlStore("job")
        self.reads = 0
        self.gate: asyncio.Event | None = None
        self.answered = asyncio.Event()
        self.fail = False

    async def hello(self, learner: str) -> None:
        assert (await self.store.hello("[]", learner, "i", 60.0, 0, True)).status == "ok"

    async def live(self) -> Live:
        self.reads += 1
        await asyncio.sleep(0)  # others ask while it is in flight
        if self.fail:
            raise StoreError("the store is away")
        live = await self.store.live()
        self.answered.set()
        if self.gate is not None:
            await self.gate.wait()
        return live


def slots(live: Live) -> set[str]:
    return {lv.learner for lv in live.learners}


def test_callers_within_the_max_age_share_one_read_and_a_later_call_reads_again() -> None:
    clock, store = Clock(), CountedStore()
    view = LiveView(store.live, max_age_s=0.1, clock=clock)

    async def run() -> None:
        await store.hello("a")
        together = await asyncio.gather(*(view.get(("a",)) for _ in range(50)))
        assert store.reads == 1
        assert all(slots(live) == {"a"} for live in together)
        clock.s += 0.09
        await store.hello("b")  # not needed by anyone: the view may not show it yet
        assert slots(await view.get(("a",))) == {"a"}
        assert store.reads == 1
        clock.s += 0.02  # past the max age
        assert slots(await view.get()) == {"a", "b"}
        assert store.reads == 2

    asyncio.run(run())


def test_a_learner_the_view_lacks_is_read_again_for_and_one_gone_costs_one_read() -> None:
    clock, store = Clock(), CountedStore()
    view = LiveView(store.live, max_age_s=0.1, clock=clock)

    async def run() -> None:
        await store.hello("a")
        await view.get()
        await store.hello("new")  # said hello after the read: its update must count as live
        assert slots(await view.get(("a", "new"))) == {"a", "new"}
        assert store.reads == 2
        # A round member whose session ended is read for once, not at every call.
        for _ in range(5):  # bounded: reading again for it until it came would never end
            live = await asyncio.wait_for(view.get(("a", "gone")), 5)
            assert slots(live) == {"a", "new"}
        assert store.reads == 3
        # The reads for age after it answer for it as well, while it is asked for.
        clock.s += 0.2
        await view.get(("gone",))
        clock.s += 0.05
        await view.get(("gone",))
        assert store.reads == 4

    asyncio.run(run())


def test_a_read_in_flight_sent_before_a_learner_was_asked_for_does_not_answer_for_it() -> None:
    clock, store = Clock(), CountedStore()
    view = LiveView(store.live, max_age_s=0.1, clock=clock)

    async def run() -> None:
        store.gate = asyncio.Event()
        first = asyncio.create_task(view.get())
        await store.answered.wait()  # the answer is held back
        await store.hello("late")
        second = asyncio.create_task(view.get(("late",)))
        await asyncio.sleep(0)
        store.gate.set()
        assert slots(await first) == set()
        assert slots(await second) == {"late"}
        assert store.reads == 2

    asyncio.run(run())


def test_the_stores_error_reaches_every_caller_and_the_next_call_reads_again() -> None:
    clock, store = Clock(), CountedStore()
    view = LiveView(store.live, max_age_s=0.1, clock=clock)

    async def run() -> None:
        store.fail = True
        failed = await asyncio.gather(*(view.get() for _ in range(3)), return_exceptions=True)
        assert all(isinstance(err, StoreError) for err in failed)
        assert store.reads == 1
        with pytest.raises(StoreError):
            await view.get()
        assert store.reads == 2
        store.fail = False
        await store.hello("a")
        assert slots(await view.get(("a",))) == {"a"}
        assert store.reads == 3

    asyncio.run(run())


def test_a_caller_cancelled_leaves_the_read_to_the_others() -> None:
    clock, store = Clock(), CountedStore()
    view = LiveView(store.live, max_age_s=0.1, clock=clock)

    async def run() -> None:
        await store.hello("a")
        store.gate = asyncio.Event()
        cancelled, waiting = asyncio.create_task(view.get()), asyncio.create_task(view.get())
        await store.answered.wait()
        cancelled.cancel()
        await asyncio.sleep(0)
        store.gate.set()
        assert slots(await waiting) == {"a"}
        assert cancelled.cancelled()
        assert store.reads == 1

    asyncio.run(run())


def test_holds_sees_a_slot_that_said_hello_at_once_and_one_gone_only_after_the_max_age() -> None:
    clock, store = Clock(), CountedStore()
    view = LiveView(store.live, max_age_s=0.1, clock=clock)

    async def run() -> None:
        await store.hello("a")
        assert await view.holds("a")
        assert not await view.holds("nobody")  # read again for it, once: not live
        assert store.reads == 2
        await store.hello("b")
        assert await view.holds("b")  # said hello after the last read: read again
        assert store.reads == 3
        await store.store.leave("a", "i", 1)  # its first session
        assert await view.holds("a")  # a view within its age still holds it
        clock.s += 0.2
        assert not await view.holds("a")
        assert store.reads == 5  # the view's age, then once more for the slot it lacks
        assert not await view.holds("a")  # and no more for it within the age
        assert store.reads == 5

    asyncio.run(run())
