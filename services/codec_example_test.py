"""A new codec is one file plus its value in proto/'s Codec enum: this file defines one (an
example, never shipped), registers it, and every part that reads the registry takes it:
lookups by name and by wire value, error feedback, segments and the synchronizer's weighed
sum; tests/test_generated.py shows it in the Helm schema and the docs. `--codec`'s choices
are the registry's names when services.config is first imported: a shipped codec registers
in services/codec.py, or in a module of its own that codec.py imports."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from services import codec as codecs
from services.blockwise import Payload, expect_len, finite
from services.gen.atoll.v1 import fragment_pb2
from services.wire import segments_header

# Its proto enum value would be added to proto/atoll/v1/fragment.proto; proto3 enums are
# open, so an unlisted number travels in a header as it is.
WIRE = 99


def _encode(x: np.ndarray, _: int) -> bytes:
    return np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fn).tobytes()


def _decode(payload: Payload, n: int, _: int) -> np.ndarray:
    expect_len(payload, n, "fp8")
    return finite(np.frombuffer(payload, ml_dtypes.float8_e4m3fn).astype(np.float32))


def _check(payload: Payload, n: int, block_size: int) -> None:
    _decode(payload, n, block_size)


def register_example(monkeypatch: pytest.MonkeyPatch) -> codecs.Codec:
    """The example codec, registered until the test ends (the registry is restored then)."""
    monkeypatch.setattr(codecs, "REGISTRY", dict(codecs.REGISTRY))
    monkeypatch.setattr(codecs, "_BY_WIRE", dict(codecs._BY_WIRE))
    about = "float8 (4-bit exponent, 3-bit mantissa), no scale"
    return codecs.register(codecs.Codec("fp8", WIRE, _encode, _decode, _check, about=about))


@pytest.fixture
def fp8(monkeypatch: pytest.MonkeyPatch) -> codecs.Codec:
    return register_example(monkeypatch)


def test_a_registered_codec_is_found_by_name_and_by_its_wire_value(fp8: codecs.Codec) -> None:
    assert codecs.by_name("fp8") is fp8
    assert codecs.by_wire(WIRE) is fp8
    header = fragment_pb2.PayloadHeader.FromString(
        segments_header(0, fp8.wire, 256, 4, []).SerializeToString()
    )
    assert codecs.by_wire(header.codec) is fp8


def test_a_name_or_wire_value_taken_is_refused(fp8: codecs.Codec) -> None:
    with pytest.raises(ValueError, match="fp8"):
        codecs.register(codecs.Codec("fp8", 100, _encode, _decode, _check))
    with pytest.raises(ValueError, match=str(WIRE)):
        codecs.register(codecs.Codec("fp8b", WIRE, _encode, _decode, _check))


def test_it_sends_with_error_feedback_in_segments_and_sums_weighed(fp8: codecs.Codec) -> None:
    rng = np.random.default_rng(0)
    feedback = codecs.ErrorFeedback(fp8, 256, chunk_bytes=1024)
    delta = rng.normal(size=5000).astype(np.float32)
    sent = np.zeros_like(delta)
    for _ in range(8):
        segments = feedback.encode(delta)
        assert len(segments) == 5  # 1024 one-byte values a segment
        sent += codecs.decode_segments(fp8, segments, delta.size, 256)
    assert feedback.residual is not None
    np.testing.assert_allclose(sent + feedback.residual, 8 * delta, rtol=1e-5, atol=1e-4)
    acc = np.zeros(delta.size, np.float32)
    for segment in codecs.unpack_segments(codecs.pack_segments(segments)):
        fp8.decode_into(acc, 0.5, segment, 256)
    np.testing.assert_array_equal(acc, codecs.decode_segments(fp8, segments, delta.size, 256) / 2)
