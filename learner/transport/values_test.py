"""The values a learner holds: assembled chunk by chunk and checked, handed on once each."""

from __future__ import annotations

import numpy as np
import pytest

from learner.transport.values import Assembly, GlobalFragment, Held
from services.codec import Segment
from services.gen.atoll.v1 import fragment_pb2
from services.wire import segments_header


def chunks(
    values: np.ndarray, version: int, per_chunk: int
) -> list[fragment_pb2.GlobalFragmentChunk]:
    """`values` as a whole float32 global value in chunks of `per_chunk` values."""
    data = values.astype("<f4").tobytes()
    segments = [
        Segment(
            start, min(per_chunk, values.size - start), data[4 * start : 4 * (start + per_chunk)]
        )
        for start in range(0, values.size, per_chunk)
    ]
    header = segments_header(3, fragment_pb2.CODEC_FP32, 0, values.size, segments)
    return [
        fragment_pb2.GlobalFragmentChunk(
            header=header,
            version=version,
            chunk_index=i,
            data=bytes(s.data),
            value_offset=s.offset,
            value_count=s.count,
        )
        for i, s in enumerate(segments)
    ]


def test_a_value_is_whole_once_its_last_chunk_is_in_and_its_checksum_holds() -> None:
    values = np.arange(10, dtype=np.float32)
    parts = chunks(values, 4, per_chunk=4)
    assembly = Assembly(parts[0], None)
    assert [assembly.feed(c) for c in parts] == [False, False, True]
    np.testing.assert_array_equal(assembly.values, values)


def test_chunks_out_of_order_or_garbled_are_refused() -> None:
    parts = chunks(np.arange(8, dtype=np.float32), 1, per_chunk=4)
    with pytest.raises(ValueError, match="out of order"):
        Assembly(parts[0], None).feed(parts[1])
    garbled = fragment_pb2.GlobalFragmentChunk()
    garbled.CopyFrom(parts[1])
    garbled.data = np.ones(4, "<f4").tobytes()
    assembly = Assembly(parts[0], None)
    assembly.feed(parts[0])
    with pytest.raises(ValueError, match="checksum"):
        assembly.feed(garbled)


def test_a_value_is_handed_on_once_and_never_behind_a_newer_one() -> None:
    held = Held()
    one, two = np.zeros(2, np.float32), np.ones(2, np.float32)
    held.deliver(GlobalFragment(0, 2, two))
    held.deliver(GlobalFragment(0, 1, one))  # older: not handed on
    held.deliver(GlobalFragment(0, 2, two))  # known: not again
    assert held.fragments.qsize() == 1
    held.hold(GlobalFragment(0, 2, two))
    held.hold(GlobalFragment(0, 1, one))
    assert held.versions() == {0: 2}


def test_versions_told_are_noticed_once_and_moved_says_what_is_new() -> None:
    held = Held()
    held.notice(1, 5)
    held.notice(1, 5)
    held.notice(1, 4)
    assert held.notices.qsize() == 1
    held.know([GlobalFragment(0, 3, np.zeros(1, np.float32))])
    assert held.moved([3, 6, 0]) == [1, 2]
