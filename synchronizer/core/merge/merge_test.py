from typing import get_args

import numpy as np
import pytest

from services.codec import CodecError, by_name
from services.config import JobConfig
from services.downlink import fused_step, step_segment
from synchronizer.core.merge import (
    REGISTRY,
    OuterOptimizer,
    StreamingSum,
    capped_weights,
    live_round_scale,
    partial_round_scale,
    staleness_weight,
    tensor_norms,
    token_weight,
)


def merged(
    updates: list[tuple[list[float], int, int]],
    *,
    rule: str = "mean",
    segments: tuple[int, ...] = (),
    scale: float = 1.0,
    weights: list[float] | None = None,
) -> np.ndarray:
    """Sum updates chunk by chunk (two chunks each) as an owner does, then read the outer
    gradient back in two slices."""
    n = len(updates[0][0])
    acc = REGISTRY[rule].new(n, segments or (n,))
    assert isinstance(acc, StreamingSum)
    for i, (delta, steps, tokens) in enumerate(updates):
        w = weights[i] if weights else token_weight(tokens, steps)
        values = np.array(delta, np.float32)
        norms = tensor_norms(values, segments or (n,))
        half = n // 2
        acc.add(0, values[:half].copy(), w, norms)
        acc.add(half, values[half:].copy(), w, norms)
        acc.counted(w, norms, 1)
    acc.prepare()
    return np.concatenate([acc.outer_gradient(0, 1, scale), acc.outer_gradient(1, n, scale)])


def test_a_provisional_weight_is_capped_by_the_rounds_other_members() -> None:
    # The first update of a fragment claimed 10^29; the round's other member weighs 10^5.
    assert capped_weights([1e29, 1e5], [True, False], 2.0) == [2e5, 1e5]
    # Both provisional: each against the other as claimed, so the honest one keeps its own.
    assert capped_weights([1e29, 1e5], [True, True], 2.0) == [2e5, 1e5]
    assert capped_weights([1e29, 1e5, 3e5], [True, True, True], 2.0) == [4e5, 1e5, 3e5]
    # Under the cap, or alone in its round (the whole round whatever it weighs): unchanged.
    assert capped_weights([1.5e5, 1e5], [True, False], 2.0) == [1.5e5, 1e5]
    assert capped_weights([1e29], [True], 2.0) == [1e29]
    # A weight capped when it began stays as it is.
    assert capped_weights([1e29, 1e5], [False, False], 2.0) == [1e29, 1e5]


def test_token_weight_is_tokens_squared_over_steps() -> None:
    assert token_weight(1000, 10) == 100_000.0
    assert token_weight(0, 10) == 0.0
    assert token_weight(10, 0) == 0.0


def test_token_weighted_merge_by_hand() -> None:
    # w1 = 200^2/10 = 4000, w2 = 100^2/10 = 1000: weights 0.8 and 0.2.
    out = merged([([1.0, 0.0], 10, 200), ([0.0, 1.0], 10, 100)])
    np.testing.assert_allclose(out, [0.8, 0.2], rtol=1e-6)


def test_a_slow_learner_with_fewer_tokens_per_step_weighs_less() -> None:
    # 100 tokens per step against the same tokens in 4x the steps: 25 per step.
    out = merged([([1.0, 1.0], 10, 1000), ([-1.0, -1.0], 40, 1000)])
    assert out[0] == pytest.approx((100_000 - 25_000) / 125_000)


def test_an_update_taken_out_again_leaves_the_sum_as_it_was() -> None:
    acc = REGISTRY["mean"].new(4, (4,))
    assert isinstance(acc, StreamingSum)
    acc.add(0, np.array([1, 2, 3, 4], np.float32), 2.0, [])
    acc.counted(2.0, [], 1)
    acc.add(0, np.array([9, 9, 9, 9], np.float32), 5.0, [])
    acc.subtract(0, np.array([9, 9, 9, 9], np.float32), 5.0, [])
    np.testing.assert_allclose(acc.outer_gradient(0, 4, 1.0), [1, 2, 3, 4])


def test_outer_nesterov_step_by_hand() -> None:
    # Fresh momentum: trace = g; update = -lr * (g + mu * trace) = -0.7 * 1.9 * g.
    opt = OuterOptimizer(lr=0.7, momentum=0.9)
    theta = np.array([1.0, 2.0], np.float32)
    g = np.array([0.1, -0.2], np.float32)
    state = opt.init(theta)
    assert [s.tolist() for s in state] == [[0.0, 0.0]]
    move = opt.move(state, g.copy(), slice(0, 2))
    np.testing.assert_allclose(theta + move, [1.0 - 0.133, 2.0 + 0.266], rtol=1e-6)
    np.testing.assert_allclose(state[0], g, rtol=1e-6)
    # Second step with the same g: trace = g + 0.9 g = 1.9 g; update = -0.7 (g + 0.9*1.9 g).
    move2 = opt.move(state, g.copy(), slice(0, 2))
    np.testing.assert_allclose(move2, -0.7 * (1 + 0.9 * 1.9) * g, rtol=1e-5)
    assert OuterOptimizer(lr=0.7, momentum=0.0).init(theta) == []


def test_a_partial_round_takes_a_partial_step() -> None:
    assert partial_round_scale(1, 3) == pytest.approx(1 / 3)
    assert partial_round_scale(2, 2) == 1.0
    out = merged([([3.0, 3.0], 10, 100)], scale=partial_round_scale(1, 3))
    np.testing.assert_allclose(out, [1.0, 1.0])


def test_radial_directional_mean_keeps_the_typical_length_per_tensor() -> None:
    # Two orthogonal unit-length updates: the plain mean is 1/sqrt(2) long; radial keeps
    # length 1 along the mean direction. Second tensor: lengths 2 and 4, same direction.
    a, b = [1.0, 0.0, 2.0, 0.0], [0.0, 1.0, 4.0, 0.0]
    mean = merged([(a, 10, 100), (b, 10, 100)], segments=(2, 2))
    np.testing.assert_allclose(mean, [0.5, 0.5, 3.0, 0.0])
    radial = merged([(a, 10, 100), (b, 10, 100)], rule="radial", segments=(2, 2))
    s = 1 / np.sqrt(2)
    np.testing.assert_allclose(radial, [s, s, 3.0, 0.0], rtol=1e-6)
    assert np.linalg.norm(radial[:2]) == pytest.approx(1.0)


def test_staleness_decay_weighs_late_updates_less() -> None:
    assert staleness_weight(2, 0.5) == 0.25  # two versions behind: a quarter of the weight
    w = token_weight(100, 10)
    out = merged(
        [([1.0, 1.0], 10, 100), ([0.0, 0.0], 10, 100)], weights=[w, w * staleness_weight(2, 0.5)]
    )
    np.testing.assert_allclose(out, [0.8, 0.8], rtol=1e-6)


@pytest.mark.parametrize("name", ["fp32", "int8", "int4-uniform"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize(("n", "block"), [(1, 256), (1001, 64), (70_001, 256)])
def test_the_compiled_outer_step_is_the_numpy_one_bit_for_bit(
    name: str, momentum: float, n: int, block: int
) -> None:
    """fused_step against OuterOptimizer.move then step_segment, as the owner ran them: the
    payload, the new value, the residual and the trace, byte for byte, through zero blocks,
    subnormal ones and blocks whose scale is below 2^-124."""
    codec = by_name(name)
    rng = np.random.default_rng(n)
    total = rng.standard_t(3, size=n).astype(np.float32)
    theta = rng.normal(size=n).astype(np.float32)
    residual = rng.normal(scale=1e-3, size=n).astype(np.float32)
    trace = rng.normal(size=n).astype(np.float32)
    if n >= 4 * block:
        special = slice(0, 4 * block)
        residual[special], trace[special], total[:block] = 0.0, 0.0, 0.0
        total[block : 2 * block] = np.float32(1e-41)
        # Blocks whose scale lands between the smallest normal and 2^-124: for 4-bit codes,
        # then for int8 (times the factor and lr below, 0.481), with subnormals among them.
        for b, top in ((2, 4.2e-37), (3, 6.2e-36)):
            tiny = rng.uniform(-top, top, size=block).astype(np.float32)
            tiny[0], tiny[1::7] = np.float32(top), np.float32(1e-42)
            total[b * block : (b + 1) * block] = tiny
    factor, lr = 0.37, 1.3
    optimizer = OuterOptimizer(lr, momentum)

    state = [trace.copy()] if momentum else []
    want_theta, want_residual = theta.copy(), residual.copy()
    every = slice(0, n)
    move = optimizer.move(state, total * np.float32(factor), every)
    np.add(move, want_residual, out=move)
    payload = step_segment(want_theta, move, want_residual, codec, block)

    got_trace = trace.copy()
    got_theta, got_residual = theta.copy(), residual.copy()
    data = fused_step(
        total,
        factor,
        got_trace if momentum else None,
        momentum,
        lr,
        got_residual,
        got_theta,
        codec,
        block,
    )
    assert data == payload
    assert got_theta.tobytes() == want_theta.tobytes()
    assert got_residual.tobytes() == want_residual.tobytes()
    if momentum:
        assert got_trace.tobytes() == state[0].tobytes()


def test_codecs_without_a_compiled_step_are_left_to_numpy() -> None:
    x = np.ones(8, np.float32)
    assert fused_step(x, 1.0, None, 0.0, 1.0, x.copy(), x.copy(), by_name("int2"), 4) is None
    # 4-bit codes with an odd block: a block is not whole bytes
    assert fused_step(x, 1.0, None, 0.0, 1.0, x.copy(), x.copy(), by_name("int4"), 3) is None


@pytest.mark.parametrize("name", ["fp32", "int8", "int4-uniform"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_step_to_values_that_are_not_finite_is_refused_as_numpy_refuses_it(
    name: str, bad: float
) -> None:
    """A round's sum that overflowed: the compiled step refuses it (the merge is given up)
    as encoding and decoding it on the numpy path does, never a delta no learner decodes."""
    codec = by_name(name)
    total = np.ones(1000, np.float32)
    total[300] = bad
    zeros = [np.zeros(1000, np.float32) for _ in range(4)]
    with pytest.raises(CodecError), np.errstate(invalid="ignore"):
        step_segment(zeros[0], total.copy(), zeros[1], codec, 64)
    with pytest.raises(CodecError):
        fused_step(total, 1.0, None, 0.0, 1.0, zeros[2], zeros[3], codec, 64)


def test_a_round_steps_by_the_live_learners_it_stands_for() -> None:
    # Two live learners, one in the round: half a step.
    assert live_round_scale({"l0"}, frozenset({"l0", "l1"})) == 0.5
    # A member whose session ended since it was admitted counts among the learners: its
    # update arrived alone beside a live learner, and takes half a step, not a full one.
    assert live_round_scale({"gone"}, frozenset({"l0"})) == 0.5
    # Nobody else live: the round is the whole job.
    assert live_round_scale({"l0"}, frozenset()) == 1.0
    assert live_round_scale({"l0", "l1"}, frozenset({"l0", "l1", "l2", "l3"})) == 0.5
    assert live_round_scale({"l0"}, None) == 1.0  # --partial-rounds full
    # A dropped member stands for nothing: beside one honest member, of four live, the
    # round is a quarter step (the honest update's own share), not half.
    live = frozenset({"l0", "l1", "l2", "l3"})
    assert live_round_scale({"l0", "l3"}, live, dropped={"l3"}) == 0.25
    assert live_round_scale({"l3"}, live, dropped={"l3"}) == 0.0


def test_the_merge_settings_choices_are_the_registrys_rules() -> None:
    """Every rule registered is a choice of --merge, and every choice a registered rule."""
    assert set(get_args(JobConfig.model_fields["merge"].annotation)) == set(REGISTRY)
    for name, rule in REGISTRY.items():
        assert rule.name == name
        assert rule.help
