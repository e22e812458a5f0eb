"""The job's live learners as a replica's fragments see them: one view for all of them, read
from the control store at most once per short interval, one read in flight at a time.

Each fragment's round is decided at every update's arrival (`ownership.py`), and a read of
the live learners costs the replica time linear in their number: read once per fragment per
arrival, a job of thousands of learners spent its replica on the reading. A view a little old
is harmless (`ownership.LIVE_MAX_AGE_S` says why); one that lacks a learner with an update in
the round is not, as the round rule would count that learner in the round but not among the
live, and could merge the round before a live learner it still waits for has sent. Such a
view is read again before it is used.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass

from synchronizer.core.rounds import Live


@dataclass(frozen=True)
class _Read:
    live: Live
    learners: frozenset[str]  # the live learners' slots
    sent_at: float  # when the read was sent (the view's clock): its age counts from here
    # Slots asked for before the read was sent and not live in it: it answers for them too.
    absent: frozenset[str]


class LiveView:
    """The live learners, read at most once per `max_age_s` for every caller; while a read is
    in flight, callers await it rather than send another."""

    def __init__(
        self,
        read: Callable[[], Awaitable[Live]],
        *,
        max_age_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read_store, self.max_age_s, self._clock = read, max_age_s, clock
        self._last: _Read | None = None
        self._reading: asyncio.Task[_Read] | None = None
        # Slots callers needed that the last read did not hold, asked for since it was sent:
        # the next read answers whether they are live.
        self._asked: set[str] = set()

    async def get(self, needed: Collection[str] = ()) -> Live:
        """The live learners as read less than `max_age_s` ago, from a read sent after each
        of the `needed` slots that it lacks was first asked for: a slot that said hello after
        the last read is in the view returned, and one no longer live costs one read, not
        one per call. The store's error is raised to every caller awaiting the read."""
        last = self._last
        if last is not None:
            answered = self._answers(last, needed)  # what it lacks is asked of the next read
            if answered and self._clock() - last.sent_at < self.max_age_s:
                return last.live
        while True:  # twice at most: a read in flight may have been sent before the asking
            last = await self._read()
            if self._answers(last, needed):
                return last.live

    async def holds(self, learner: str) -> bool:
        """Whether the slot is live in a view read less than `max_age_s` ago, or read after
        it was first asked for (a slot that has just said hello is seen at once)."""
        await self.get((learner,))
        assert self._last is not None
        return learner in self._last.learners

    def _answers(self, read: _Read, needed: Collection[str]) -> bool:
        """Whether `read` says of each needed slot whether it is live: it holds the slot, or
        was sent after the slot was asked for. The slots it lacks are asked for again, so
        that the next read answers for them as well."""
        lacking = {learner for learner in needed if learner not in read.learners}
        self._asked |= lacking
        return lacking <= read.absent

    async def _read(self) -> _Read:
        """The read in flight, or a new one; a caller cancelled leaves it to the others."""
        if self._reading is None:
            self._reading = asyncio.create_task(self._send())
        return await asyncio.shield(self._reading)

    async def _send(self) -> _Read:
        asked, self._asked = self._asked, set()
        sent_at = self._clock()
        try:
            live = await self._read_store()
        finally:
            self._reading = None  # on an error, the callers ask again at their next call
        learners = frozenset(lv.learner for lv in live.learners)
        self._last = _Read(live, learners, sent_at, frozenset(asked - learners))
        return self._last
