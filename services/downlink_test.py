import numpy as np
import pytest

from services import codec as codecs
from services.downlink import apply_delta, apply_segment, encode_delta


@pytest.mark.parametrize(
    ("name", "owed"),
    [
        ("fp32", 0.0),
        ("bf16", 0.002),
        ("int8", 0.002),
        ("int4-uniform", 0.03),
        ("e3m0", 0.05),
        ("int2", 0.5),
        ("sign", 0.75),
        ("topk", 0.2),
    ],
)
def test_learners_rebuild_every_version_bit_for_bit_and_follow_the_optimizer(
    name: str, owed: float
) -> None:
    codec = codecs.by_name(name)
    rng = np.random.default_rng(1)
    server = learner = rng.normal(size=5000).astype(np.float32)
    optimizer = server.astype(np.float64)  # where the outer steps alone would have led
    residual = None
    for _ in range(200):
        # The outer optimizer steps from the canonical value, as the merger does.
        step = (-0.01 * rng.standard_t(3, size=server.size)).astype(np.float32)
        optimizer += step
        payload, server, residual = encode_delta(
            server, server + step, residual, codec, 256, chunk_bytes=1500
        )
        learner = apply_delta(learner, payload, codec, 256)
        assert learner.tobytes() == server.tobytes()  # the canonical value, bit for bit
        # Error feedback: what learners hold plus what is still owed is the optimizer's
        # value, so encoding errors never accumulate over versions.
        np.testing.assert_allclose(server + residual, optimizer, atol=1e-4)
    assert residual is not None
    assert np.abs(residual).max() <= owed


@pytest.mark.parametrize("name", sorted(codecs.REGISTRY))
@pytest.mark.parametrize(("n", "block"), [(1, 2), (7, 4), (1001, 64), (70_001, 256)])
def test_a_delta_decoded_onto_its_base_is_decoding_then_adding_bit_for_bit(
    name: str, n: int, block: int
) -> None:
    """apply_segment's one compiled pass (Codec.decode_onto, where the codec has one) writes
    what decoding the segment and adding it to the base in float32 writes, in place too."""
    codec = codecs.by_name(name)
    rng = np.random.default_rng(n)
    base = rng.normal(size=n + 3).astype(np.float32)
    x = (0.01 * rng.standard_t(3, size=n)).astype(np.float32)
    segment = codecs.Segment(3, n, codec.encode(x, block))
    want = base.copy()
    want[3:] = np.add(base[3:], codec.decode(segment.data, n, block), dtype=np.float32)
    out = np.full(n + 3, np.nan, np.float32)
    apply_segment(base, out, segment, codec, block)
    assert out[3:].tobytes() == want[3:].tobytes()
    assert np.isnan(out[:3]).all()  # nothing outside the segment written
    in_place = base.copy()
    apply_segment(in_place, in_place, segment, codec, block)  # as values.py rebuilds
    assert in_place.tobytes() == want.tobytes()
    fused = codec.blockwise is not None and codec.blockwise.fused is not None
    assert codec.decode_onto(base, out, segment, block) == (
        fused and block % codec.blockwise.per_byte == 0  # type: ignore[union-attr]
    )
