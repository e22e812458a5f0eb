import numpy as np
import pytest

from synchronizer.merge import Contribution, OuterOptimizer, merge_contributions, token_weight


def contribution(delta: list[float], c_steps: int, c_tokens: int) -> Contribution:
    return Contribution("u", "l", np.array(delta, np.float32), c_steps, c_tokens, 0, 1.0)


def test_token_weight_is_tokens_squared_over_steps() -> None:
    assert token_weight(1000, 10) == 100_000.0
    assert token_weight(0, 10) == 0.0
    assert token_weight(10, 0) == 0.0


def test_token_weighted_merge_by_hand() -> None:
    # w1 = 200^2/10 = 4000, w2 = 100^2/10 = 1000: weights 0.8 and 0.2.
    a = contribution([1.0, 0.0], 10, 200)
    b = contribution([0.0, 1.0], 10, 100)
    merged, weights, scale = merge_contributions([a, b])
    assert weights == [4000.0, 1000.0]
    assert scale == 1.0
    np.testing.assert_allclose(merged, [0.8, 0.2], rtol=1e-6)


def test_a_slow_learner_with_fewer_tokens_per_step_weighs_less() -> None:
    fast = contribution([1.0], 10, 1000)  # 100 tokens per step
    slow = contribution([-1.0], 40, 1000)  # same tokens, 4x the steps: 25 per step
    merged, _, _ = merge_contributions([fast, slow])
    assert merged[0] == pytest.approx((100_000 - 25_000) / 125_000)


def test_outer_nesterov_step_by_hand() -> None:
    # Fresh momentum: trace = g; update = -lr * (g + mu * trace) = -0.7 * 1.9 * g.
    opt = OuterOptimizer(lr=0.7, momentum=0.9)
    theta = np.array([1.0, 2.0], np.float32)
    g = np.array([0.1, -0.2], np.float32)
    state = opt.init(theta)
    assert [s.tolist() for s in state] == [[0.0, 0.0]]
    theta1, state1 = opt.step(theta, state, g)
    np.testing.assert_allclose(theta1, [1.0 - 0.133, 2.0 + 0.266], rtol=1e-6)
    np.testing.assert_allclose(state1[0], g, rtol=1e-6)
    # Second step with the same g: trace = g + 0.9 g = 1.9 g; update = -0.7 (g + 0.9*1.9 g).
    theta2, _ = opt.step(theta1, state1, g)
    np.testing.assert_allclose(theta2, theta1 - 0.7 * (1 + 0.9 * 1.9) * g, rtol=1e-5)


def test_a_partial_round_takes_a_partial_step() -> None:
    a = Contribution("u1", "a", np.array([3.0], np.float32), 10, 100, 0, 1.0)
    merged, _, scale = merge_contributions([a], live_learners=3)
    assert scale == pytest.approx(1 / 3)
    np.testing.assert_allclose(merged, [1.0])
    full, _, scale = merge_contributions(
        [a, Contribution("u2", "b", np.array([3.0], np.float32), 10, 100, 0, 1.0)], 2
    )
    assert scale == 1.0
    np.testing.assert_allclose(full, [3.0])


def test_radial_directional_mean_keeps_the_typical_length_per_tensor() -> None:
    # Two orthogonal unit-length updates: the plain mean halves... to 1/sqrt(2) long; radial
    # keeps length 1 along the mean direction. Second tensor: lengths 2 and 4, same direction.
    a = Contribution("a", "la", np.array([1, 0, 2, 0], np.float32), 10, 100, 0, 1.0)
    b = Contribution("b", "lb", np.array([0, 1, 4, 0], np.float32), 10, 100, 0, 1.0)
    mean, _, _ = merge_contributions([a, b])
    np.testing.assert_allclose(mean, [0.5, 0.5, 3.0, 0.0])
    radial, weights, _ = merge_contributions([a, b], method="radial", segments=[2, 2])
    s = 1 / np.sqrt(2)
    np.testing.assert_allclose(radial, [s, s, 3.0, 0.0], rtol=1e-6)
    assert weights == [1000.0, 1000.0]
    assert np.linalg.norm(radial[:2]) == pytest.approx(1.0)


def test_staleness_decay_weighs_late_updates_less() -> None:
    fresh = Contribution("a", "la", np.array([1.0], np.float32), 10, 100, 4, 1.0)
    late = Contribution("b", "lb", np.array([0.0], np.float32), 10, 100, 2, 1.0)
    merged, weights, _ = merge_contributions([fresh, late], version=4, staleness_decay=0.5)
    assert weights == [1000.0, 250.0]  # two versions behind: a quarter of the weight
    np.testing.assert_allclose(merged, [0.8])
    plain, _, _ = merge_contributions([fresh, late], version=4)  # decay 1: no change
    np.testing.assert_allclose(plain, [0.5])
