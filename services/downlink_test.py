import numpy as np
import pytest

from services import codec as codecs
from services.downlink import apply_delta, encode_delta


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4-uniform", "e3m0"])
def test_learners_rebuild_every_version_bit_for_bit_and_follow_the_optimizer(name: str) -> None:
    codec = codecs.by_name(name)
    rng = np.random.default_rng(1)
    server = learner = rng.normal(size=5000).astype(np.float32)
    target = server.copy()
    residual = np.zeros_like(server)
    for _ in range(200):
        target = (target - 0.01 * rng.standard_t(3, size=target.size)).astype(np.float32)
        before = residual
        payload, server, residual = encode_delta(server, target, residual, codec, 256)
        learner = apply_delta(learner, payload, codec, 256)
        assert learner.tobytes() == server.tobytes()  # the canonical value, bit for bit
        # Error feedback: the gap to the optimizer's value is what the residuals hold, so it
        # never accumulates over versions.
        np.testing.assert_allclose(target - server, residual - before, atol=1e-5)
    assert np.abs(server - target).max() < 0.05
