import math
import re

import jax
import jax.numpy as jnp
import pytest

from learner import model
from learner.model import (
    TransformerConfig,
    attention_implementation,
    forward,
    init_params,
    make_loss,
    resolve_dtype,
)


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


def test_auto_dtype_is_bfloat16_on_accelerators_and_float32_on_cpu() -> None:
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", "gpu") == "bfloat16"
    assert resolve_dtype("auto", "tpu") == "bfloat16"
    assert resolve_dtype("float32", "gpu") == "float32"
    assert resolve_dtype("auto") == "float32"  # the tests run on CPU
    with pytest.raises(ValueError, match="--dtype"):
        resolve_dtype("float16")


def test_attention_is_cudnn_on_nvidia_gpus_for_16_bit_inputs_and_xla_elsewhere() -> None:
    cuda = "cuda 12080"
    assert attention_implementation(jnp.dtype(jnp.bfloat16), cuda) == "cudnn"
    assert attention_implementation(jnp.dtype(jnp.float16), cuda) == "cudnn"
    assert attention_implementation(jnp.dtype(jnp.float32), cuda) == "xla"
    assert attention_implementation(jnp.dtype(jnp.bfloat16), "rocm 6.3") == "xla"
    assert attention_implementation(jnp.dtype(jnp.bfloat16), "cpu") == "xla"
    assert attention_implementation(jnp.dtype(jnp.bfloat16), "PJRT C API\nTFRT TPU v5") == "xla"


def test_attention_falls_back_to_xla_where_cudnn_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model, "attention_implementation", lambda *_: "cudnn")
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    with pytest.warns(UserWarning, match="cuDNN attention unavailable"):
        out = jax.jit(model.attention)(q, q, q)  # no cuDNN on CPU: refused when traced
    assert out.dtype == jnp.bfloat16


def _matmul_precisions(hlo: str) -> set[str]:
    """The precision every dot_general of StableHLO text multiplies in: its algorithm's
    operand precision when it names one (XLA's attention backward does, on float32
    operands), else its operands' element types."""
    found = set()
    for line in hlo.splitlines():
        if "stablehlo.dot_general" not in line:
            continue
        named = re.findall(r"[lr]hs_precision_type = ([a-z0-9]+)", line)
        operands = line.rsplit(": (", 1)[1].split(") ->")[0]
        found.update(named or re.findall(r"x([a-z]+[0-9]+)>", operands))
    return found


def test_bfloat16_computes_in_bf16_and_keeps_parameters_gradients_and_loss_float32() -> None:
    cfg = TransformerConfig(layers=1, width=32, heads=2, context=16, compute_dtype="bfloat16")
    params = init_params(cfg, 0)
    assert {str(v.dtype) for v in params.values()} == {"float32"}
    batch = jnp.tile(jnp.arange(17, dtype=jnp.int32)[None] * 7 % 256, (2, 1))
    loss_and_grad = jax.value_and_grad(make_loss(cfg))
    hlo = jax.jit(loss_and_grad).lower(params, batch).as_text()
    assert _matmul_precisions(hlo) == {"bf16"}  # every matmul, attention's, backward's
    assert "f64" not in hlo
    loss, grads = jax.jit(loss_and_grad)(params, batch)
    assert loss.dtype == jnp.float32
    assert abs(float(loss) - math.log(256)) < 0.2
    assert {str(g.dtype) for g in grads.values()} == {"float32"}
    assert model.forward(cfg, params, batch[:, :-1]).dtype == jnp.float32
