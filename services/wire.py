"""How an encoded payload travels: as segments that decode on their own (services.codec),
one wire chunk each, under a header every chunk repeats.

Chunks stay well below the gRPC message limit. The header's checksum is XXH3-64 of all the
segments' bytes in order, so a receiver checks a payload it never holds whole as its chunks
go by.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from services.codec import Segment
from services.gen.atoll.v1 import fragment_pb2

DEFAULT_MAX_CHUNK_BYTES = 1 << 20  # 1 MiB, a quarter of gRPC's default message limit


def segments_header(
    fragment: int, codec: int, block_size: int, num_elements: int, segments: Sequence[Segment]
) -> fragment_pb2.PayloadHeader:
    """The header of a payload sent as `segments` (no copy of their bytes is made)."""
    hasher = xxhash.xxh3_64()
    for s in segments:
        hasher.update(s.data)
    return fragment_pb2.PayloadHeader(
        fragment=fragment,
        codec=codec,  # type: ignore[arg-type]
        block_size=block_size,
        num_elements=num_elements,
        checksum=hasher.intdigest(),
        chunk_count=len(segments),
        total_bytes=sum(len(s.data) for s in segments),
    )
