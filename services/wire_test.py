import pytest

from services.gen.atoll.v1 import fragment_pb2
from services.wire import ChunkAssembler, WireError, make_header, split

PAYLOAD = bytes(range(256)) * 40  # 10240 bytes


def header(payload: bytes = PAYLOAD, chunk: int = 1000) -> fragment_pb2.PayloadHeader:
    return make_header(0, fragment_pb2.CODEC_FP32, 0, len(payload) // 4, payload, chunk)


def test_chunks_reassemble_to_the_payload() -> None:
    h = header()
    chunks = split(PAYLOAD, 1000)
    assert len(chunks) == h.chunk_count == 11
    assembler = ChunkAssembler()
    results = [assembler.feed(h, i, c) for i, c in enumerate(chunks)]
    assert results[:-1] == [None] * 10
    assert results[-1] == PAYLOAD


def test_out_of_order_chunks_are_refused_and_the_next_payload_starts_clean() -> None:
    h = header()
    chunks = split(PAYLOAD, 1000)
    assembler = ChunkAssembler()
    assembler.feed(h, 0, chunks[0])
    with pytest.raises(WireError, match="out of order"):
        assembler.feed(h, 2, chunks[2])
    results = [assembler.feed(h, i, c) for i, c in enumerate(chunks)]
    assert results[-1] == PAYLOAD


def test_a_corrupted_chunk_fails_the_checksum() -> None:
    h = header()
    chunks = split(PAYLOAD, 1000)
    chunks[4] = b"\x00" + chunks[4][1:]
    assembler = ChunkAssembler()
    for i, c in enumerate(chunks[:-1]):
        assembler.feed(h, i, c)
    with pytest.raises(WireError, match="checksum"):
        assembler.feed(h, len(chunks) - 1, chunks[-1])


def test_a_header_that_changes_mid_payload_is_refused() -> None:
    h = header()
    other = header(PAYLOAD[:-4])
    chunks = split(PAYLOAD, 1000)
    assembler = ChunkAssembler()
    assembler.feed(h, 0, chunks[0])
    with pytest.raises(WireError, match="header changed"):
        assembler.feed(other, 1, chunks[1])


def test_more_bytes_than_announced_are_refused() -> None:
    h = header(PAYLOAD[:1000], 1000)
    with pytest.raises(WireError, match="more than"):
        ChunkAssembler().feed(h, 0, PAYLOAD[:1001])
