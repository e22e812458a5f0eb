"""Chunking of encoded payloads, and their checked reassembly.

Payloads travel in chunks well below the gRPC message limit. One stream carries one payload
at a time; the assembler refuses chunks out of order, headers that change between chunks of
one payload, sizes that disagree with the header and payloads whose checksum fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.codec import checksum
from services.gen.atoll.v1 import fragment_pb2

DEFAULT_MAX_CHUNK_BYTES = 1 << 20  # 1 MiB, a quarter of gRPC's default message limit
MAX_PAYLOAD_BYTES = 1 << 31


class WireError(ValueError):
    """A chunk sequence is malformed; the message says what and what to do."""


def make_header(
    fragment: int, codec: int, block_size: int, num_elements: int, payload: bytes, max_chunk: int
) -> fragment_pb2.PayloadHeader:
    return fragment_pb2.PayloadHeader(
        fragment=fragment,
        codec=codec,  # type: ignore[arg-type]
        block_size=block_size,
        num_elements=num_elements,
        checksum=checksum(payload),
        chunk_count=max(1, -(-len(payload) // max_chunk)),
        total_bytes=len(payload),
    )


def split(payload: bytes, max_chunk: int) -> list[bytes]:
    """The payload cut into chunks of at most `max_chunk` bytes (at least one chunk)."""
    if max_chunk < 1:
        raise WireError(f"max_chunk must be positive, got {max_chunk}")
    view = memoryview(payload)
    return [bytes(view[i : i + max_chunk]) for i in range(0, len(payload), max_chunk)] or [b""]


@dataclass
class ChunkAssembler:
    """Collects the chunks of one payload at a time."""

    header: fragment_pb2.PayloadHeader | None = None
    next_index: int = 0
    parts: list[bytes] = field(default_factory=list)
    received: int = 0

    def reset(self) -> None:
        self.header, self.next_index, self.parts, self.received = None, 0, [], 0

    def feed(self, header: fragment_pb2.PayloadHeader, index: int, data: bytes) -> bytes | None:
        """Add one chunk; return the whole payload once its last chunk is in.

        On any error the partial payload is dropped, so the next payload starts clean.
        """
        try:
            return self._feed(header, index, data)
        except WireError:
            self.reset()
            raise

    def _feed(self, header: fragment_pb2.PayloadHeader, index: int, data: bytes) -> bytes | None:
        if index == 0:
            if self.header is not None:
                raise WireError(
                    f"a new payload started before chunk {self.next_index} of "
                    f"{self.header.chunk_count} of the previous one; send chunks in order"
                )
            if header.chunk_count < 1 or header.total_bytes > MAX_PAYLOAD_BYTES:
                raise WireError(
                    f"header announces {header.chunk_count} chunks, {header.total_bytes} bytes;"
                    f" need at least 1 chunk and at most {MAX_PAYLOAD_BYTES} bytes"
                )
            self.header = header
        elif self.header is None or index != self.next_index:
            expected = self.next_index if self.header is not None else 0
            raise WireError(f"chunk {index} arrived out of order; expected chunk {expected}")
        elif header != self.header:
            raise WireError("header changed between chunks of one payload; resend it whole")
        assert self.header is not None
        self.received += len(data)
        if self.received > self.header.total_bytes:
            raise WireError(
                f"chunks carry more than the {self.header.total_bytes} bytes the header announces"
            )
        self.parts.append(data)
        self.next_index = index + 1
        if self.next_index < self.header.chunk_count:
            return None
        payload = b"".join(self.parts)
        expected_header = self.header
        self.reset()
        if len(payload) != expected_header.total_bytes:
            raise WireError(
                f"payload is {len(payload)} bytes, header announces {expected_header.total_bytes}"
            )
        if checksum(payload) != expected_header.checksum:
            raise WireError("payload checksum mismatch: bytes were corrupted; resend the update")
        return payload
