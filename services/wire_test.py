import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from services import codec as codecs
from services.gen.atoll.v1 import fragment_pb2, session_pb2
from services.wire import bytes_field, join_field, segments_header, split_field

DATA = session_pb2.UpdateChunk.DESCRIPTOR.fields_by_name["data"].number
CHUNK_DATA = fragment_pb2.GlobalFragmentChunk.DESCRIPTOR.fields_by_name["data"].number
FRAGMENT = session_pb2.SynchronizerMessage.DESCRIPTOR.fields_by_name["fragment"].number


def test_the_header_checks_the_segments_as_one_payload() -> None:
    x = np.random.default_rng(0).normal(size=3000).astype(np.float32)
    segments, _ = codecs.encode_segments(codecs.by_name("int8"), x, 256, 700)
    h = segments_header(3, fragment_pb2.CODEC_INT8, 256, x.size, segments)
    joined = b"".join(s.data for s in segments)
    assert h.checksum == codecs.checksum(joined)
    assert (h.chunk_count, h.total_bytes) == (len(segments), len(joined))
    assert (h.fragment, h.num_elements, h.block_size) == (3, x.size, 256)


@settings(max_examples=300, deadline=None)
@given(
    fields=st.lists(
        st.one_of(
            st.builds(lambda v: session_pb2.UpdateChunk(seq=v), st.integers(0, 2**64 - 1)),
            st.builds(lambda v: session_pb2.UpdateChunk(data=v), st.binary(max_size=300)),
            st.builds(lambda v: session_pb2.UpdateChunk(learner_id=v), st.text(max_size=20)),
            st.builds(lambda v: session_pb2.UpdateChunk(compute_seconds=v), st.floats()),
            st.builds(
                lambda v: session_pb2.UpdateChunk(tensor_norms=v),
                st.lists(st.floats(width=32), max_size=4),
            ),
            st.builds(
                lambda n: session_pb2.UpdateChunk(header=fragment_pb2.PayloadHeader(fragment=n)),
                st.integers(0, 2**32 - 1),
            ),
        ),
        max_size=8,
    ),
    unknown=st.binary(max_size=4),
)
def test_a_chunks_payload_is_read_in_place_and_the_rest_parses_as_the_whole_does(
    fields: list[session_pb2.UpdateChunk], unknown: bytes
) -> None:
    # Concatenated messages merge as one (the later field winning): any field order, and
    # the payload field several times or not at all. An unknown field (number 99) too.
    message = b"".join(f.SerializeToString() for f in fields)
    message += b"\x9a\x06" + bytes([len(unknown)]) + unknown
    whole = session_pb2.UpdateChunk.FromString(message)
    split = split_field(message, DATA)
    if sum(1 for f in fields if f.data) > 1:  # the payload field twice: parsed whole instead
        assert split is None
        return
    assert split is not None
    rest, data = split
    assert bytes(data) == whole.data
    assert data.obj is message  # a view, not a copy
    parsed = session_pb2.UpdateChunk.FromString(rest)
    assert not parsed.data
    parsed.data = whole.data
    assert parsed == whole
    assert parsed.SerializeToString() == whole.SerializeToString()  # unknown field kept


def test_a_message_of_many_fields_is_not_scanned_field_by_field() -> None:
    """A message of millions of tiny fields (one gRPC message can hold 8 MiB of them) would
    hold the event loop for seconds in a Python scan: past a few dozen, None (parse it
    whole)."""
    chunk = session_pb2.UpdateChunk(seq=3, data=b"payload").SerializeToString()
    assert split_field(chunk, DATA, max_fields=2) == (
        session_pb2.UpdateChunk(seq=3).SerializeToString(),
        memoryview(b"payload"),
    )
    assert split_field(chunk + b"\x18\x04", DATA, max_fields=2) is None
    assert split_field(chunk + b"\x18\x00" * (1 << 20), DATA) is None


@pytest.mark.parametrize(
    "message",
    [
        b"\x18",  # a varint field's value missing
        b"\x18\xff\xff",  # a varint that never ends
        b"\x18" + b"\xff" * 11 + b"\x01",  # a varint of 12 bytes
        b"\x4a\x05abc",  # the payload shorter than its length says
        b"\x4a\xff\xff\xff\xff\x0f",  # a length of 4 GiB
        b"\x39\x00\x00",  # a fixed64 field cut short
        b"\x0b",  # a group (field 1)
        b"\x00\x01",  # field number 0
        b"\xca\x80\x80\x80\x80\x00\x00",  # the payload field's key in 6 bytes
    ],
)
def test_a_malformed_chunk_is_refused_as_the_parser_refuses_it(message: bytes) -> None:
    with pytest.raises(DecodeError):
        split_field(message, DATA)
    with pytest.raises(DecodeError):
        session_pb2.UpdateChunk.FromString(message)


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(max_size=70_000),  # lengths of one, two and three varint bytes
    version=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**64 - 1),
    delta=st.booleans(),
    fragment=st.integers(0, 2**32 - 1),
)
def test_a_pushed_chunk_built_around_its_bytes_parses_as_protobuf_builds_it(
    data: bytes, version: int, offset: int, delta: bool, fragment: int
) -> None:
    header = fragment_pb2.PayloadHeader(fragment=fragment, total_bytes=len(data))
    head = fragment_pb2.GlobalFragmentChunk(
        header=header, version=version, value_offset=offset, delta=delta
    )
    view = memoryview(data)
    built = b"".join(bytes_field(FRAGMENT, join_field(head.SerializeToString(), CHUNK_DATA, view)))
    head.data = data
    expected = session_pb2.SynchronizerMessage(fragment=head)
    assert session_pb2.SynchronizerMessage.FromString(built) == expected
    if data:  # (an empty bytes field protobuf leaves out; this writes it, empty)
        assert len(built) == expected.ByteSize()
    # and the receiver's in-place read finds the same bytes
    inner = split_field(built, FRAGMENT)
    assert inner is not None
    split = split_field(bytes(inner[1]), CHUNK_DATA)
    assert split is not None
    assert bytes(split[1]) == data
