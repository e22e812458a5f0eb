import numpy as np
import pytest

from services import codec as codecs
from services.downlink import apply_delta, encode_delta


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
