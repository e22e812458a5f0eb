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
