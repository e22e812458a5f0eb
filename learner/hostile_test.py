import numpy as np
import pytest

from learner.hostile import HOSTILITIES, corrupt


@pytest.mark.parametrize("kind", HOSTILITIES)
def test_each_kind_sends_what_it_says(kind: str) -> None:
    rng = np.random.default_rng(0)
    delta = rng.standard_normal(1000).astype(np.float32)
    anchor = rng.standard_normal(1000).astype(np.float32) * 10
    out = corrupt(kind, delta, anchor, np.random.default_rng(1))  # type: ignore[arg-type]
    assert out.dtype == np.float32
    assert out.shape == delta.shape
    norm = float(np.linalg.norm(delta))
    expected = {
        "sign-flip": -delta,
        "x100": delta * 100,
        "replace": anchor * np.float32(0.99),
    }
    if kind in expected:
        np.testing.assert_allclose(out, expected[kind], rtol=1e-6)
    else:  # noise of the honest update's norm, unrelated to it
        assert float(np.linalg.norm(out)) == pytest.approx(norm, rel=1e-5)
        cosine = float(out @ delta) / norm**2
        assert abs(cosine) < 0.2
