"""How an encoded payload travels: as segments that decode on their own (services.codec),
one wire chunk each, under a header every chunk repeats.

Chunks stay well below the gRPC message limit. The header's checksum is XXH3-64 of all the
segments' bytes in order, so a receiver checks a payload it never holds whole as its chunks
go by. A receiver reads a chunk's payload bytes where gRPC put them (`split_field`): parsing
the message would copy them twice more.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash
from google.protobuf.message import DecodeError

from services.codec import DEFAULT_MAX_CHUNK_BYTES as DEFAULT_MAX_CHUNK_BYTES
from services.codec import Segment
from services.gen.atoll.v1 import fragment_pb2


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


MAX_VARINT_BYTES = 10
MAX_KEY_BYTES = 5  # a field number and wire type fit in 32 bits
# A chunk has about 16 top-level fields; past this many, a message is parsed whole.
MAX_SPLIT_FIELDS = 64


def _varint(message: bytes, pos: int) -> tuple[int, int]:
    """The base-128 varint at `pos` and the position after it."""
    value, shift, end = 0, 0, min(len(message), pos + MAX_VARINT_BYTES)
    while pos < end:
        byte = message[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise DecodeError("a varint runs past the end of the message or past 10 bytes")


def split_field(
    message: bytes, number: int, max_fields: int = MAX_SPLIT_FIELDS
) -> tuple[bytes, memoryview] | None:
    """A serialized protobuf message without its top-level length-delimited field `number`,
    and that field's bytes as a view into `message`, not a copy (empty if absent). Parsing
    a 1 MiB chunk copies its payload into the message and again into a new bytes object
    when read: on the synchronizer, a fifth of its event loop's time. None for a message of
    more than `max_fields` top-level fields or with the field more than once: the caller
    parses it whole (in C, faster than this loop over many fields). Raises DecodeError for
    a message malformed at the top level."""
    end, pos, span = len(message), 0, None
    for _ in range(max_fields):
        if pos >= end:
            break
        start = pos
        key, pos = _varint(message, pos)
        if pos - start > MAX_KEY_BYTES:
            raise DecodeError("a field's key is longer than 5 bytes")
        kind, field = key & 7, key >> 3
        if field == 0:
            raise DecodeError("field number 0 is not valid")
        if kind == 0:
            _, pos = _varint(message, pos)
        elif kind == 1:
            pos += 8
        elif kind == 5:
            pos += 4
        elif kind == 2:
            length, pos = _varint(message, pos)
            pos += length
        else:  # groups: none in this protocol
            raise DecodeError(f"wire type {kind} is not used by this protocol")
        if pos > end:
            raise DecodeError("a field runs past the end of the message")
        if kind == 2 and field == number:
            if span is not None:
                return None
            span = (start, pos - length, pos)
    else:
        if pos < end:
            return None
    if span is None:
        return message, memoryview(message)[0:0]
    start, first, last = span
    return message[:start] + message[last:], memoryview(message)[first:last]


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def bytes_field(number: int, parts: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """The length-delimited field `number` holding `parts` back to back (a nested message's
    bytes, or a bytes field's), as parts: the key, the length, then `parts`, not copied."""
    length = sum(len(p) for p in parts)
    return [_encode_varint((number << 3) | 2), _encode_varint(length), *parts]


def join_field(head: bytes, number: int, data: bytes | memoryview) -> list[bytes | memoryview]:
    """A serialized message (`head`, without field `number`) with its bytes field `number`
    holding `data`, as parts: joined, they parse as the message with the field set, and
    `data` is copied once, where protobuf would copy it into the message and again into
    its serialization. The inverse of `split_field`."""
    return [head, *bytes_field(number, [data])]
