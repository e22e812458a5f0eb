"""The built-in model: a byte-level decoder-only transformer in plain JAX.

Parameters are a flat dict keyed by slash paths (`blocks/3/attn/qkv`), which is exactly what
the fragment layout reads: layer indices come from the names, and no network library sits
between the arrays and the wire.

Mixed precision: parameters (and so the optimizer's master weights) stay float32; with
`compute_dtype` bfloat16 each is cast where it is used, so matmuls and attention run in
bf16 while norms' statistics, the logits' softmax and the loss are float32. Attention names
its kernel: left to itself, `jax.nn.dot_product_attention` takes XLA's path even on an
NVIDIA GPU, about a third as fast as cuDNN's fused one.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp

Params = dict[str, jax.Array]
LossFn = Callable[[Params, jax.Array], jax.Array]
VOCAB = 256  # bytes
DTYPES = ("float32", "bfloat16")
FUSED_DTYPES = (jnp.bfloat16, jnp.float16)  # what cuDNN's fused attention takes


def resolve_dtype(choice: str, platform: str | None = None) -> str:
    """`--dtype auto`: bfloat16 on accelerators (GPU, TPU), float32 on CPU."""
    if choice != "auto":
        if choice not in DTYPES:
            raise ValueError(f"--dtype {choice!r}: choose auto or one of {list(DTYPES)}")
        return choice
    platform = platform or jax.default_backend()
    return "bfloat16" if platform in ("gpu", "cuda", "rocm", "tpu") else "float32"


def attention_implementation(
    dtype: jnp.dtype, platform_version: str | None = None
) -> Literal["cudnn", "xla"]:
    """cuDNN's fused kernel on NVIDIA GPUs for 16-bit inputs, XLA's everywhere else (CPU,
    TPU, AMD GPUs, float32, which the fused kernel does not take)."""
    if platform_version is None:
        platform_version = jax.devices()[0].client.platform_version
    if "cuda" in platform_version.lower() and jnp.dtype(dtype) in FUSED_DTYPES:
        return "cudnn"
    return "xla"


def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention over (batch, time, heads, head_dim), by the kernel named above; if
    cuDNN refuses these shapes when the step is traced, XLA's."""
    if attention_implementation(q.dtype) == "cudnn":
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        except (NotImplementedError, ValueError, RuntimeError) as err:
            warnings.warn(f"cuDNN attention unavailable ({err}); using XLA's", stacklevel=2)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


@dataclass(frozen=True)
class TransformerConfig:
    layers: int = 4
    width: int = 128
    heads: int = 4
    context: int = 128
    compute_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(
                f"--heads {self.heads} must divide --width {self.width}; e.g. --heads "
                f"{max(h for h in range(1, self.heads + 1) if self.width % h == 0)}"
            )

    @property
    def parameters(self) -> int:
        d = self.width
        return VOCAB * d + self.context * d + d + self.layers * (12 * d * d + 2 * d)


def init_params(cfg: TransformerConfig, seed: int) -> Params:
    """Initial parameters, made by one compiled function (one compilation, which a restarted
    learner loads from the compile cache, instead of one per random op)."""
    params: Params = _init(cfg, jnp.asarray(seed, jnp.uint32))
    return params


@partial(jax.jit, static_argnums=0)
def _init(cfg: TransformerConfig, seed: jax.Array) -> Params:
    d = cfg.width
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 4 * cfg.layers))

    def normal(shape: tuple[int, ...], std: float) -> jax.Array:
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    residual_std = 0.02 / math.sqrt(2 * cfg.layers)
    params: Params = {
        "embed": normal((VOCAB, d), 0.02),
        "pos": normal((cfg.context, d), 0.01),
        "ln_f/scale": jnp.ones((d,), jnp.float32),
    }
    for i in range(cfg.layers):
        params |= {
            f"blocks/{i}/ln1/scale": jnp.ones((d,), jnp.float32),
            f"blocks/{i}/attn/qkv": normal((d, 3 * d), 0.02),
            f"blocks/{i}/attn/out": normal((d, d), residual_std),
            f"blocks/{i}/ln2/scale": jnp.ones((d,), jnp.float32),
            f"blocks/{i}/mlp/in": normal((d, 4 * d), 0.02),
            f"blocks/{i}/mlp/out": normal((4 * d, d), residual_std),
        }
    return params


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x * jax.lax.rsqrt(var + 1e-6)).astype(x.dtype) * scale.astype(x.dtype)


def forward(cfg: TransformerConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Logits (batch, time, 256) for byte tokens (batch, time)."""
    dtype = jnp.dtype(cfg.compute_dtype)
    b, t = tokens.shape
    d, h = cfg.width, cfg.heads
    x = (params["embed"][tokens] + params["pos"][:t]).astype(dtype)
    for i in range(cfg.layers):
        p = f"blocks/{i}/"
        y = _rms_norm(x, params[p + "ln1/scale"])
        qkv = (y @ params[p + "attn/qkv"].astype(dtype)).reshape(b, t, 3, h, d // h)
        att = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
        x = x + att.reshape(b, t, d) @ params[p + "attn/out"].astype(dtype)
        y = _rms_norm(x, params[p + "ln2/scale"])
        y = jax.nn.gelu(y @ params[p + "mlp/in"].astype(dtype))
        x = x + y @ params[p + "mlp/out"].astype(dtype)
    x = _rms_norm(x, params["ln_f/scale"])
    return (x @ params["embed"].astype(dtype).T).astype(jnp.float32)


def make_loss(cfg: TransformerConfig) -> LossFn:
    """Mean next-byte cross-entropy (nats) over a batch of windows of context+1 bytes."""

    def loss(params: Params, batch: jax.Array) -> jax.Array:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = forward(cfg, params, inputs)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return loss
