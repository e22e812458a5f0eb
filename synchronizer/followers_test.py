"""Unit tests of the followers' rules: whom uploads wait for, the wait itself, and the
pushed messages."""

import asyncio
import contextlib
import time

import numpy as np
import pytest

from services.gen.atoll.v1 import session_pb2
from synchronizer import fetch, followers
from synchronizer.followers import (
    DOWNLINK_BACKLOG_BYTES,
    DOWNLINK_STALLED_S,
    Downlink,
    Follower,
    most_behind,
)


def test_uploads_wait_only_while_most_reading_learners_are_behind_on_the_downlink() -> None:
    def behind(*queued: int, stalled: tuple[int, ...] = ()) -> bool:
        queues = [(b, 99.0) for b in queued] + [(b, 90.0) for b in stalled]
        return most_behind(queues, 100.0, mark=100, stalled_s=2.0)

    assert not behind()  # no learner here: nothing to wait for
    assert behind(101)
    assert not behind(100)
    # One slow learner alone holds no upload back; most of them behind does.
    assert not behind(0, 10**9)
    assert not behind(0, 0, 10**9, 10**9)
    assert behind(0, 200, 300)
    assert behind(150, 200, 10**9, 0, 101)
    # A learner whose queue has not moved for 2 s is not reading: it does not count...
    assert not behind(stalled=(10**9,))
    assert not behind(0, stalled=(10**9, 10**9))
    # ...though one with nothing queued, however long ago it last moved, is caught up.
    assert not behind(200, stalled=(0, 0))
    assert behind(200, 300, stalled=(0,))


def _follower(queued: int, moved_ago: float = 0.0) -> Follower:
    follower = Follower()
    follower.queued_bytes, follower.drained_at = queued, time.monotonic() - moved_ago
    return follower


BEHIND = DOWNLINK_BACKLOG_BYTES + 1


def test_an_upload_waits_until_the_learners_queues_drain_and_is_woken_as_they_do() -> None:
    async def run() -> tuple[float, float]:
        a, b = _follower(BEHIND), _follower(BEHIND)
        downlink = Downlink({0: a, 1: b, 2: _follower(BEHIND)})

        async def drain() -> None:  # the streams send what is queued to their learners
            await asyncio.sleep(0.3)
            downlink.sent(a, BEHIND)
            await asyncio.sleep(0.3)
            downlink.sent(b, BEHIND)

        task = asyncio.create_task(drain())
        waited = await downlink.caught_up()
        await task
        return waited, await downlink.caught_up()

    waited, again = asyncio.run(run())
    assert 0.5 <= waited < 1.5  # until a second of the three queues drained: most are in
    assert again == 0.0  # caught up: no wait


def test_a_learner_that_stops_reading_holds_uploads_back_only_until_it_counts_as_stalled() -> None:
    async def run() -> float:
        # Its queue last moved 1.5 s ago: not reading, once DOWNLINK_STALLED_S have passed.
        downlink = Downlink({0: _follower(BEHIND, moved_ago=DOWNLINK_STALLED_S - 0.5)})
        return await downlink.caught_up()

    waited = asyncio.run(run())
    assert 0.4 <= waited < 1.5  # woken by the stall's deadline, not by any send


def test_an_upload_waits_at_most_the_cap_for_learners_that_read_but_stay_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(followers, "DOWNLINK_WAIT_MAX_S", 0.5)

    async def run() -> float:
        a = _follower(10 * BEHIND)
        downlink = Downlink({0: a})

        async def trickle() -> None:  # reading, a little at a time: never caught up
            while True:
                await asyncio.sleep(0.05)
                downlink.sent(a, 1)

        task = asyncio.create_task(trickle())
        try:
            return await asyncio.wait_for(downlink.caught_up(), 5.0)
        finally:
            task.cancel()

    waited = asyncio.run(run())
    assert 0.5 <= waited < 1.0


@pytest.mark.parametrize(("n", "chunk_bytes"), [(1, 64), (1000, 400), (1000, 4000), (0, 64)])
def test_a_whole_value_is_built_as_protobuf_would_serialize_it(n: int, chunk_bytes: int) -> None:
    """The whole-value push copies each segment once; its messages parse as the messages
    protobuf builds from `value_chunks` (a fetch's answer) do."""
    values = np.arange(n, dtype="<f4").view(np.uint8).data
    built = followers.value_messages(3, 7, values, chunk_bytes)
    chunks = fetch.value_chunks(3, 7, values, chunk_bytes)
    assert [v for v, _ in built] == [7] * len(chunks)
    for (_, data), chunk in zip(built, chunks, strict=True):
        assert session_pb2.SynchronizerMessage.FromString(data) == (
            session_pb2.SynchronizerMessage(fragment=chunk)
        )


def test_a_follower_that_stops_reading_is_ended_and_what_was_queued_to_it_let_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(followers, "OUTBOX_LIMIT", 3)

    async def run() -> tuple[bool, int, int, bool]:
        handler = asyncio.create_task(asyncio.sleep(60))  # the call's handler, blocked
        follower = Follower(task=handler)
        for _ in range(4):
            follower.send(b"x" * 100)
        assert follower.queued_bytes == 400
        assert not follower.ended
        follower.send(b"x" * 100)  # the fifth: over the limit
        follower.send(b"x" * 100)  # and nothing more is queued after that
        with contextlib.suppress(asyncio.CancelledError):
            await handler
        return follower.ended, follower.outbox.qsize(), follower.queued_bytes, handler.cancelled()

    assert asyncio.run(run()) == (True, 0, 0, True)


def test_a_follower_too_many_bytes_behind_is_ended_though_under_the_message_limit() -> None:
    async def run() -> tuple[bool, bool, int]:
        handler = asyncio.create_task(asyncio.sleep(60))  # the call's handler, blocked
        follower = Follower(task=handler)
        follower.send(b"x" * 900, limit_bytes=1000)
        follower.send(b"x" * 100, limit_bytes=1000)  # exactly at the limit: still queued
        at_limit = follower.ended
        follower.send(b"x", limit_bytes=1000)  # one byte over: the call ends
        with contextlib.suppress(asyncio.CancelledError):
            await handler
        return at_limit, follower.ended, follower.queued_bytes

    assert asyncio.run(run()) == (False, True, 0)


def test_a_message_larger_than_the_backlog_limit_still_goes_to_a_follower_not_behind() -> None:
    async def run() -> tuple[bool, int]:
        follower = Follower()
        follower.send(b"x" * 5000, limit_bytes=1000)  # nothing queued before it
        return follower.ended, follower.queued_bytes

    assert asyncio.run(run()) == (False, 5000)


def test_the_backlog_limit_holds_twice_the_whole_values_a_replica_owns() -> None:
    assert followers.backlog_limit(10, floor=1000) == 1000
    assert followers.backlog_limit(1_000, floor=1000) == 8_000  # 1,000 float32 values, twice
    assert followers.backlog_limit(0) == followers.FOLLOWER_BACKLOG_MIN_BYTES
