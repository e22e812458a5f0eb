"""The inner optimizer: AdamW, or AdamW that normalizes as if its batch were pooled with the
other learners' batches.

A learner's AdamW divides each step by the root of its second-moment estimate, which on a
small batch is mostly gradient noise; data-parallel AdamW on M learners' joint batch divides
by a noise M times smaller. The mean of M learners' AdamW updates is therefore not the
update data-parallel training would make: where a coordinate's gradient is mostly noise, it
is about sqrt(M) times too small. `pooled_adamw` estimates each coordinate's noise as
`nu - mu^2` (second moment less squared first moment, both AdamW's own averages) and
divides it by `pool`, the number of learners' batches the merge will average:

    step = mu_hat / (sqrt(mu_hat^2 + (nu_hat - mu_hat^2) / pool) + eps)

With `pool` 1 it is AdamW exactly. The optimizer state is AdamW's, so checkpoints do not
change.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

B1, B2, EPS = 0.9, 0.95, 1e-8


def scale_by_pooled_adam(pool: float) -> optax.GradientTransformation:
    if pool < 1.0:
        raise ValueError(f"pool {pool} must be at least 1 (the learner's own batch)")
    adam = optax.scale_by_adam(B1, B2, EPS)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        _, state = adam.update(updates, state, params)
        count = state.count.astype(jnp.float32)
        c1, c2 = 1.0 - B1**count, 1.0 - B2**count

        def step(mu: jax.Array, nu: jax.Array) -> jax.Array:
            m, v = mu / c1, nu / c2
            out: jax.Array = m / (jnp.sqrt(m * m + jnp.maximum(v - m * m, 0.0) / pool) + EPS)
            return out

        return jax.tree.map(step, state.mu, state.nu), state

    return optax.GradientTransformation(adam.init, update)


def inner_optimizer(
    schedule: optax.Schedule, weight_decay: float, pool: float = 1.0
) -> optax.GradientTransformation:
    """AdamW (b1 0.9, b2 0.95) on `schedule`; with `pool` above 1, pooled as above."""
    if pool == 1.0:
        return optax.adamw(schedule, b1=B1, b2=B2, eps=EPS, weight_decay=weight_decay)
    return optax.chain(
        scale_by_pooled_adam(pool),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(schedule),
    )
