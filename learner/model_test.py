import math

import jax
import jax.numpy as jnp
import pytest

from learner.model import TransformerConfig, forward, init_params, make_loss


def test_parameter_count_and_shapes() -> None:
    cfg = TransformerConfig(layers=2, width=32, heads=4, context=16)
    params = init_params(cfg, 0)
    assert sum(v.size for v in params.values()) == cfg.parameters
    logits = forward(cfg, params, jnp.zeros((3, 16), jnp.int32))
    assert logits.shape == (3, 16, 256)


def test_initial_loss_is_near_chance_and_falls_with_a_few_steps() -> None:
    cfg = TransformerConfig(layers=1, width=32, heads=2, context=16)
    params = init_params(cfg, 0)
    loss_fn = jax.jit(make_loss(cfg))
    batch = jnp.tile(jnp.arange(17, dtype=jnp.int32)[None] * 7 % 256, (4, 1))
    first = float(loss_fn(params, batch))
    assert abs(first - math.log(256)) < 0.2
    grad = jax.jit(jax.grad(make_loss(cfg)))
    for _ in range(20):
        params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grad(params, batch))
    assert float(loss_fn(params, batch)) < first - 0.5


def test_heads_must_divide_width() -> None:
    with pytest.raises(ValueError, match="must divide"):
        TransformerConfig(width=30, heads=4)
