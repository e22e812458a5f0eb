"""The step clock: when each dispatched step is done, whatever the host does meanwhile."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest

from learner.loop import StepClock


@jax.jit
def _step(x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ x).sum()


def test_a_step_taken_after_the_host_was_away_is_timed_when_its_devices_were_done() -> None:
    x = jnp.ones((256, 256), jnp.float32) / 256
    _step(x).block_until_ready()  # compiled
    clock = StepClock()
    try:
        started = time.monotonic()
        clock.dispatched(_step(x), started)
        clock.dispatched(_step(x), time.monotonic())
        assert clock.in_flight == 2
        time.sleep(0.5)  # the host away, as in a sync mode's wait for its merge
        first = clock.next_done()
        second = clock.next_done()
        assert clock.in_flight == 0
        taken = time.monotonic()
        # Each done long before the host took it, and in order.
        assert started <= first[2] <= second[2] < started + 0.25 < taken
        assert float(first[0]) == pytest.approx(float(second[0]))
    finally:
        clock.close()


def test_the_inner_optimizer_clips_a_gradient_to_its_global_norm_first() -> None:
    from learner.loop import adamw
    from learner.settings import LearnerSettings

    params = {"w": jnp.zeros(3), "b": jnp.zeros(2)}
    big = {"w": jnp.array([30.0, -40.0, 0.0]), "b": jnp.array([0.0, 0.0])}  # norm 50
    small = {"w": jnp.array([0.1, 0.2, -0.1]), "b": jnp.array([0.3, -0.2])}
    scaled = jax.tree.map(lambda g: g / 50.0, big)  # what a clip at norm 1 leaves of it

    def updates(clip: float, first: dict[str, jax.Array]) -> jax.Array:
        tx = adamw(LearnerSettings(id="l", lr=0.1, warmup_steps=0, steps=10, clip_norm=clip))
        state = tx.init(params)
        _, state = tx.update(first, state, params)
        second, _ = tx.update(small, state, params)
        return jnp.concatenate([second["w"], second["b"]])

    clipped = updates(1.0, big)
    assert jnp.allclose(clipped, updates(1.0, scaled), atol=1e-6)  # the same after the clip
    # Unclipped, the large gradient dominates AdamW's second moment and the next step differs.
    assert not jnp.allclose(updates(0.0, big), clipped, atol=1e-3)
    assert LearnerSettings(id="l").clip_norm == 1.0  # on by default


def test_the_clip_gives_what_the_library_clip_gives_above_and_below_the_norm() -> None:
    import optax

    from learner.loop import clip_to_global_norm

    for scale in (0.01, 0.5, 3.0, 1e4):
        grads = {"w": jnp.array([3.0, -4.0]) * scale, "b": jnp.array([[1.0], [2.0]]) * scale}
        ours, _ = clip_to_global_norm(2.0).update(grads, optax.EmptyState())
        theirs, _ = optax.clip_by_global_norm(2.0).update(grads, optax.EmptyState())
        for name in grads:
            assert jnp.allclose(ours[name], theirs[name], rtol=1e-6), (scale, name)
    zeros = {"w": jnp.zeros(3)}
    out, _ = clip_to_global_norm(1.0).update(zeros, optax.EmptyState())
    assert jnp.array_equal(out["w"], zeros["w"])  # a zero gradient stays zero, not NaN
