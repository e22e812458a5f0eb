"""What a learner of several processes needs of a real synchronizer.

Up: updates in parts; parts that tile the fragment merge as one update; overlaps, gaps,
disagreeing parts and a missing part are refused, every part with the same reason, and
leave nothing behind in the round's sum. Down: a session that asked for notices is told new
versions, not sent their values; each process fetches its own ranges at a chosen version."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
import redis

from cluster.redis_server import RedisServer
from learner.client import SynchronizerClient
from services import codec as codecs
from services.gen.atoll.v1 import fragment_pb2, session_pb2
from tests import support
from tests.conftest import SpawnSynchronizer

FRAGMENT = 1
N = support.layout(2).fragments[FRAGMENT].num_elements
REJECTED, RECEIVED = session_pb2.ACK_STATUS_REJECTED, session_pb2.ACK_STATUS_RECEIVED


def part(
    delta: np.ndarray, ranges: Sequence[tuple[int, int]], k: int, parts: int, seq: int, **kw: int
) -> list[session_pb2.UpdateChunk]:
    """Part k: the fp32 values of `ranges` (start, end), 100 values a chunk."""
    segments = [
        codecs.Segment(a, min(b, a + 100) - a, delta[a : min(b, a + 100)].tobytes())
        for start, b in ranges
        for a in range(start, b, 100)
    ]
    chunks = support.chunks_for(
        FRAGMENT,
        segments,
        codec=fragment_pb2.CODEC_FP32,
        block_size=0,
        num_elements=N,
        seq=seq,
        **kw,  # type: ignore[arg-type]
    )
    for chunk in chunks:
        chunk.part, chunk.parts = k, parts
    return chunks


def send(c: SynchronizerClient, parts: Sequence[list[session_pb2.UpdateChunk]]) -> list[Any]:
    """Send the parts side by side under the session's incarnation (an update of any other
    is refused once the slot's current one has sent to the fragment)."""
    for chunk in (chunk for chunks in parts for chunk in chunks):
        chunk.incarnation = chunk.incarnation or c.incarnation
    with ThreadPoolExecutor(len(parts)) as pool:
        return list(pool.map(c.ingest_raw, parts))


def wait_until(check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_parts_that_tile_the_fragment_merge_as_one_update_and_bad_ones_change_nothing(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    sync = spawn_synchronizer(
        "--fragments", "2", "--grace-seconds", "0", "--downlink-codec", "fp32",
        "--outer-lr", "1.0", "--parts-timeout-s", "2",
    )  # fmt: skip
    c = support.client([sync.address], "l0")
    r = redis.Redis(port=redis_server.port)
    try:
        support.initialize(c, 2)
        initial = c.fetch_state([FRAGMENT])[0].values
        delta = np.random.default_rng(1).normal(scale=0.01, size=N).astype(np.float32)
        half = [(0, 300), (600, N)], [(300, 600)]  # interleaved

        # One part alone: abandoned after the timeout, retryable.
        (ack,) = send(c, [part(delta, half[0], 0, 2, seq=10)])
        assert ack.status == REJECTED
        assert "lacked parts [1]" in ack.reason
        assert ack.code == 14  # UNAVAILABLE: the learner's processes send it again
        # Overlapping parts, parts leaving a gap, parts that disagree: all refused.
        bad = {
            "overlap": [part(delta, [(0, 400)], 0, 2, 11), part(delta, [(300, N)], 1, 2, 11)],
            "cover it exactly": [
                part(delta, [(0, 100)], 0, 2, 12),
                part(delta, [(200, N)], 1, 2, 12),
            ],
            "disagrees": [
                part(delta, half[0], 0, 2, 13),
                part(delta, half[1], 1, 2, 13, c_steps=11),
            ],
        }
        for words, parts in bad.items():
            acks = send(c, parts)
            assert all(a.status == REJECTED for a in acks), (words, acks)
            assert any(words in a.reason for a in acks), (words, [a.reason for a in acks])
        time.sleep(0.3)
        assert support.version(r, FRAGMENT) == 0
        assert support.pending(r, 2) == []

        # The good update: two interleaved parts, answered together, merged once.
        good = [part(delta, half[0], 0, 2, seq=20), part(delta, half[1], 1, 2, seq=20)]
        assert [a.status for a in send(c, good)] == [RECEIVED, RECEIVED]
        wait_until(lambda: support.version(r, FRAGMENT) == 1)
        assert [e["uids"] for e in support.commit_log(r, FRAGMENT)] == [[f"l0/{c.incarnation}/20"]]
        # Nothing of the refused attempts stayed in the sum: theta - lr * delta exactly.
        merged = c.fetch_state([FRAGMENT])[0].values
        np.testing.assert_allclose(merged, initial - delta, rtol=0, atol=1e-6)
        # A part sent again gets the same answer; with other bytes, it is refused.
        assert c.ingest_raw(good[1]).status == RECEIVED
        other = part(delta * 2, half[1], 1, 2, seq=20)
        assert "other bytes" in send(c, [other])[0].reason
        time.sleep(0.3)
        assert support.version(r, FRAGMENT) == 1
    finally:
        c.close()


def test_a_notices_session_is_told_versions_and_ranges_are_fetched_at_a_version(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    sync = spawn_synchronizer("--fragments", "2", "--grace-seconds", "0")
    c = support.client([sync.address], "l0", version_notices=True)
    r = redis.Redis(port=redis_server.port)
    try:
        support.initialize(c, 2)
        initial = c.fetch_state([0])[0].values
        down = c.stats.bytes_down
        for v in range(2):
            c.wait_ack(support.send_delta(c, 0, 2, v, seed=v), 10, received=True)
            wait_until(lambda v=v: support.version(r, 0) == v + 1)  # type: ignore[misc]
            wait_until(lambda v=v: c.known_versions.get(0) == v + 1)  # type: ignore[misc]
            if v == 0:  # the initial value (it has no commit entry) is the first keyframe
                first = c.fetch_ranges({0: [(0, 10)]}, versions={0: 0})[0]
                np.testing.assert_array_equal(first.values, initial[:10])
        assert c.fragments.empty()  # told, not sent
        assert c.stats.bytes_down - down < 4 * N  # acks, notices and one range fetch
        notices = []
        while not c.notices.empty():
            notices.append(c.notices.get())
        assert notices == [(0, 1), (0, 2)]
        whole = c.fetch_state([0])[0].values
        wanted = [(0, 10), (100, 50), (1000, 1048)]
        got = c.fetch_ranges({0: wanted}, versions={0: 2})[0]
        assert got.version == 2
        assert got.checksum == support.commit_log(r, 0)[-1]["checksum"]
        np.testing.assert_array_equal(
            got.values, np.concatenate([whole[a : a + n] for a, n in wanted])
        )
        # Versions since the keyframe (here the initial value) are kept; later ones are not
        # there yet.
        assert c.fetch_ranges({0: wanted}, versions={0: 1})[0].version == 1
        again = c.fetch_ranges({0: [(0, 10)]}, versions={0: 0})[0]
        np.testing.assert_array_equal(again.values, initial[:10])
        with pytest.raises(grpc.RpcError) as gone:
            c.fetch_ranges({0: [(0, 10)]}, versions={0: 3})
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as bad:
            c.fetch_ranges({0: [(100, 10), (0, 10)]})
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        c.close()


def test_first_values_never_pin_memory_once_known_and_open_parts_are_few_per_slot(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    # A slot once made a replica hold one whole-fragment buffer per call of first values in
    # parts (48 calls: 860 MB for a minute), on a fragment that had its value already.
    # The parts timeout leaves the first two calls open for as long as a loaded machine may
    # take to bring the third (at 3 s it once had let them go first).
    sync = spawn_synchronizer("--fragments", "2", "--parts-timeout-s", "10")
    c = support.client([sync.address], "l0")
    r = redis.Redis(port=redis_server.port)
    try:
        values = np.zeros(N, np.float32)

        def first_values(seq: int, k: int = 0) -> list[session_pb2.UpdateChunk]:
            chunks = part(values, [(0, N // 2)] if k == 0 else [(N // 2, N)], k, 2, seq)
            for chunk in chunks:
                chunk.kind = session_pb2.UPDATE_KIND_INITIAL
            return chunks

        # Not initialized yet: two updates in parts may be open on a fragment, not three.
        with ThreadPoolExecutor(3) as pool:
            waiting = [pool.submit(send, c, [first_values(seq)]) for seq in (1, 2)]
            time.sleep(1.0)
            third = send(c, [first_values(3)])[0]
            assert third.status == REJECTED, third
            assert "open" in third.reason, third
            assert all(w.result()[0].status == REJECTED for w in waiting)  # timed out
        support.initialize(c, 2)
        version = support.version(r, FRAGMENT)
        # Initialized: first values are answered at once, before a byte is read.
        for seq in (10, 11, 12):
            (ack,) = send(c, [first_values(seq)])
            assert ack.status == session_pb2.ACK_STATUS_ALREADY_INITIALIZED, ack
        assert support.version(r, FRAGMENT) == version
    finally:
        c.close()


def test_a_part_refused_before_its_update_gathers_fails_every_part_at_once(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer
) -> None:
    # Part 1 arrives and waits for part 0; part 0 is refused at its header (a block size
    # over the maximum). Part 1's call once hung until --parts-timeout-s.
    sync = spawn_synchronizer(
        "--fragments", "2", "--grace-seconds", "0", "--parts-timeout-s", "60",
    )  # fmt: skip
    c = support.client([sync.address], "l0")
    r = redis.Redis(port=redis_server.port)
    try:
        support.initialize(c, 2)
        delta = np.random.default_rng(2).normal(scale=0.01, size=N).astype(np.float32)
        good = part(delta, [(300, N)], 1, 2, seq=30)
        bad = part(delta, [(0, 300)], 0, 2, seq=30)
        for chunk in bad:
            chunk.header.block_size = codecs.MAX_BLOCK_SIZE + 1
        for chunk in (*good, *bad):
            chunk.incarnation = c.incarnation
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(c.ingest_raw, good)
            time.sleep(1.0)  # part 1 is in, waiting for part 0
            started = time.monotonic()
            refused = c.ingest_raw(bad)
            sibling = waiting.result(timeout=20)
        assert refused.status == REJECTED
        assert sibling.status == REJECTED, sibling
        assert sibling.reason == refused.reason
        assert time.monotonic() - started < 10
        time.sleep(0.3)
        assert support.pending(r, 2) == []
        # The update sent whole and right merges.
        good = [part(delta, [(0, 300)], 0, 2, seq=31), part(delta, [(300, N)], 1, 2, seq=31)]
        assert [a.status for a in send(c, good)] == [RECEIVED, RECEIVED]
        wait_until(lambda: support.version(r, FRAGMENT) == 1)
    finally:
        c.close()
