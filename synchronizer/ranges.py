"""Fetching some value ranges of a fragment, at a chosen version: how each process of a
learner that spans several hosts receives its own shard of every new global value.

The values travel as float32 (4 bytes a value), exactly those asked for, so each process
receives only its own share; a learner of one process receives encoded deltas of whole
fragments instead (services/downlink.py). A version stays fetchable while the tensor store
keeps its keyframe and the deltas after it (the last VALUE_EVERY versions at least,
values.py), so the processes of one learner can all adopt the same version whenever each of
them asks.
"""

from __future__ import annotations

import numpy as np
import xxhash

from services import codec as codecs
from services.gen.atoll.v1 import fragment_pb2, synchronizer_pb2
from synchronizer import values
from synchronizer.core.admission import Rejection, Status
from synchronizer.store.control import ControlStore
from synchronizer.store.tensors import TensorStore
from synchronizer.values import RebuiltValues, float32_bytes

MAX_RANGES = 1 << 16  # ranges of one fragment in one fetch


def check_ranges(wanted: synchronizer_pb2.ValueRanges, size: int) -> list[tuple[int, int]]:
    """The (offset, count) pairs asked for: increasing, disjoint, inside the fragment."""
    offsets, counts = list(wanted.offsets), list(wanted.counts)
    if len(offsets) != len(counts) or not 0 < len(offsets) <= MAX_RANGES:
        raise _invalid(f"give 1..{MAX_RANGES} ranges, one count per offset")
    after = 0
    for offset, count in zip(offsets, counts, strict=True):
        if offset < after or count < 1 or offset + count > size:
            raise _invalid(
                f"range {offset}+{count} is out of order, empty or past the fragment's {size} "
                "values; ranges must increase and not overlap"
            )
        after = offset + count
    return list(zip(offsets, counts, strict=True))


async def value_at(
    store: ControlStore,
    tensors: TensorStore,
    fragment: int,
    version: int | None,
    rebuilt: RebuiltValues,
) -> tuple[int, np.ndarray]:
    """A fragment's float32 value at `version` (None: the current one)."""
    try:
        return await rebuilt.get(store, tensors, fragment, version)
    except values.VersionGone as err:
        raise Rejection(
            "bad_request",
            Status.NOT_FOUND,
            f"version {version} of fragment {fragment} is not kept ({err}); fetch the current one",
        ) from None
    except LookupError as err:
        raise Rejection("bad_request", Status.FAILED_PRECONDITION, str(err)) from None


def range_chunks(
    fragment: int,
    version: int,
    value: np.ndarray,
    ranges: list[tuple[int, int]],
    chunk_bytes: int,
) -> list[fragment_pb2.GlobalFragmentChunk]:
    """The values of `ranges` as float32 chunks; the header's checksum and sizes cover these
    chunks alone, `value_checksum` the whole value."""
    values = float32_bytes(value)
    step = max(1, chunk_bytes // 4)
    pieces = [
        (start, min(offset + count, start + step) - start)
        for offset, count in ranges
        for start in range(offset, offset + count, step)
    ]
    data = [bytes(values[4 * start : 4 * (start + count)]) for start, count in pieces]
    hasher = xxhash.xxh3_64()
    for d in data:
        hasher.update(d)
    header = fragment_pb2.PayloadHeader(
        fragment=fragment,
        codec=fragment_pb2.CODEC_FP32,
        num_elements=len(values) // 4,
        checksum=hasher.intdigest(),
        chunk_count=len(pieces),
        total_bytes=sum(len(d) for d in data),
    )
    whole = codecs.checksum(values)
    return [
        fragment_pb2.GlobalFragmentChunk(
            header=header,
            version=version,
            chunk_index=i,
            data=d,
            value_offset=start,
            value_count=count,
            value_checksum=whole,
        )
        for i, ((start, count), d) in enumerate(zip(pieces, data, strict=True))
    ]


def _invalid(message: str) -> Rejection:
    return Rejection("bad_request", Status.INVALID_ARGUMENT, message)
