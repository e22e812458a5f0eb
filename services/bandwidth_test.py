import pytest

from services.bandwidth import dp_equivalent_bytes


def test_ring_all_reduce_bytes() -> None:
    # 4 learners, 1000 parameters, 10 steps each: 2*3/4*4*1000 = 6000 bytes per learner-step.
    assert dp_equivalent_bytes(1000, 4, 40) == pytest.approx(240_000)
    assert dp_equivalent_bytes(1000, 1, 40) == 0.0
