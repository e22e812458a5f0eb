"""Error feedback and the int8 and int4 encoders on the learner's device.

With these codecs a fragment's update is encoded where it was computed: the residual stays
on the device, and only the encoded bytes (and the per-tensor norms the protocol sends) are
copied to the host. The bytes are those of the numpy encoders in services.codec, bit for bit,
so the synchronizer's decoders read them unchanged. Three things keep them so:

- No division. XLA divides approximately on GPUs (`div.full`) and by a constant through its
  reciprocal; each block's reciprocal of its scale is computed here in integer arithmetic,
  correctly rounded as numpy's division is, and values are multiplied by it.
- Values below float32's smallest normal are set to zero first, by both encoders: XLA
  flushes them anyway, numpy would not.
- The one product that feeds a subtraction (the decoded value, taken from the corrected delta
  to leave the residual) goes through an integer XOR with a zero the compiler cannot see, so
  it is not fused into an FMA, which would round once where numpy rounds twice.

Other codecs stay on the host (services.codec.ErrorFeedback).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from services.blockwise import blocks_of, finite
from services.codec import FLOAT32_TINY, UNIFORM_CODES, Codec, Segment, segment_values

# Codecs encoded on the device: the largest code of each uniform quantizer.
LARGEST_CODE = {name: largest for name, (largest, _) in UNIFORM_CODES.items()}
NORM_ROWS = 1024  # values summed on the device per partial sum of squares


def supports(codec: Codec) -> bool:
    """Whether `codec` encodes on the device."""
    return codec.name in LARGEST_CODE


def reciprocal(scales: jax.Array) -> jax.Array:
    """1 / scales in float32, correctly rounded (nearest, ties to even) as IEEE division
    rounds it, for scales that are zero (giving zero) or positive normal floats below 2^126.

    A scale m * 2^(e - 150) (m its 24-bit significand) has the reciprocal
    (2^48 / m) * 2^(102 - e); the quotient is found by long division, 8 bits at a time so
    the shifted remainder (below m < 2^24) fits 32 bits, then rounded to 24 bits."""
    bits = lax.bitcast_convert_type(scales, jnp.uint32)
    exponent = (bits >> 23).astype(jnp.int32)
    significand = (bits & 0x7FFFFF) | 0x800000
    quotient = jnp.zeros_like(significand)
    remainder = jnp.ones_like(significand)
    for _ in range(6):  # 2^48 / m, 8 bits at a time
        remainder = remainder << 8
        quotient = (quotient << 8) | lax.div(remainder, significand)
        remainder = lax.rem(remainder, significand)
    # The quotient lies in (2^24, 2^25]: keep 24 bits, round half to even.
    kept = quotient >> 1
    dropped = quotient & 1
    rest = (remainder != 0).astype(jnp.uint32)
    kept = kept + (dropped & (rest | (kept & 1)))
    carry = kept >> 24  # rounding up to 2^24 adds a bit
    kept = kept >> carry
    exponent = 253 - exponent + carry.astype(jnp.int32)
    out = (exponent.astype(jnp.uint32) << 23) | (kept & 0x7FFFFF)
    return jnp.where(scales > 0, lax.bitcast_convert_type(out, jnp.float32), jnp.float32(0))


def _flush_tiny(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.abs(x) < FLOAT32_TINY, jnp.float32(0), x)


def uniform_codes(x: jax.Array, block_size: int, largest: int) -> tuple[jax.Array, jax.Array]:
    """The blocks' scales and the codes that services.codec.uniform_payload defines, on the
    device (the codes as float32, blocks x block_size, the last block padded with zeros)."""
    nb = blocks_of(x.size, block_size)
    blocks = jnp.pad(_flush_tiny(x), (0, nb * block_size - x.size)).reshape(nb, block_size)
    scales = _flush_tiny(jnp.max(jnp.abs(blocks), axis=1) * jnp.float32(1 / largest))
    codes = jnp.round(blocks * reciprocal(scales)[:, None])  # to nearest, ties to even
    return scales, jnp.clip(codes, -largest, largest)


@dataclass(frozen=True)
class _Plan:
    """What one fragment's encoding compiles for."""

    size: int
    block_size: int
    largest: int
    step: int  # values a segment
    tensor_sizes: tuple[int, ...]

    @property
    def segments(self) -> int:
        return max(1, blocks_of(self.size, self.step))


def _unfused(x: jax.Array, zero: jax.Array) -> jax.Array:
    """x, through an integer XOR with a zero known only at run time: no FMA can take in
    the product that made x."""
    bits = lax.bitcast_convert_type(x, jnp.uint32) ^ zero
    return lax.bitcast_convert_type(bits, jnp.float32)


def _body(codes: jax.Array, plan: _Plan) -> jax.Array:
    """The codes as the payloads' bytes: int8, one a byte; int4, q + 8 two a byte (the
    first in the low nibble), each segment packed on its own (segments x bytes)."""
    flat = codes.reshape(-1)[: plan.size]
    if plan.largest == LARGEST_CODE["int8"]:
        return flat.astype(jnp.int8)
    nibbles = (flat + 8).astype(jnp.uint8)
    rows = jnp.pad(nibbles, (0, plan.segments * plan.step - plan.size))
    rows = rows.reshape(plan.segments, plan.step)
    if plan.step % 2:
        rows = jnp.pad(rows, ((0, 0), (0, 1)))
    pairs = rows.reshape(plan.segments, -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _square_partials(decoded: jax.Array, plan: _Plan) -> jax.Array:
    """Sums of squares over rows of NORM_ROWS values of each tensor, in order: the host
    adds each tensor's in float64 (a float32 sum of millions of squares drifts)."""
    parts = []
    start = 0
    for size in plan.tensor_sizes:
        part = decoded[start : start + size]
        start += size
        rows = blocks_of(size, NORM_ROWS)
        padded = jnp.pad(part, (0, rows * NORM_ROWS - size)).reshape(rows, NORM_ROWS)
        parts.append(jnp.sum(padded * padded, axis=1))
    return jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.float32)


def _feedback(
    delta: jax.Array, residual: jax.Array | None, zero: jax.Array, plan: _Plan
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    corrected = delta if residual is None else delta + residual
    scales, codes = uniform_codes(corrected, plan.block_size, plan.largest)
    decoded = (codes * scales[:, None]).reshape(-1)[: plan.size]
    decoded = _unfused(decoded, zero)
    return scales, _body(codes, plan), _square_partials(decoded, plan), corrected - decoded


@partial(jax.jit, static_argnames="plan")
def _feedback_on_delta(
    delta: jax.Array, residual: jax.Array | None, zero: jax.Array, plan: _Plan
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    return _feedback(delta.astype(jnp.float32), residual, zero, plan)


def _flat(leaves: Sequence[jax.Array]) -> jax.Array:
    return jnp.concatenate([leaf.reshape(-1).astype(jnp.float32) for leaf in leaves])


@partial(jax.jit, static_argnames="plan")
def _feedback_on_leaves(
    anchor: list[jax.Array],
    theta: list[jax.Array],
    residual: jax.Array | None,
    zero: jax.Array,
    plan: _Plan,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    return _feedback(_flat(anchor) - _flat(theta), residual, zero, plan)


def encode(codec: Codec, x: Any, block_size: int) -> bytes:
    """One payload encoded on the device: codec.encode(x, block_size), bit for bit."""
    feedback = DeviceFeedback(codec, block_size, chunk_bytes=1 << 62)
    (segment,) = feedback.encode(x)
    return segment.data


@dataclass
class DeviceFeedback:
    """services.codec.ErrorFeedback on the learner's device: the same segments, bit for
    bit, for the codecs `supports` names. The residual stays on the device; `residual`
    copies it to the host (a checkpoint) and takes one back (a restore)."""

    codec: Codec
    block_size: int
    chunk_bytes: int = 1 << 20  # encoded bytes per segment, at most (one wire chunk each)
    tensor_sizes: tuple[int, ...] = ()  # the fragment's tensors, for `norms`
    norms: tuple[float, ...] = ()  # each tensor's L2 norm of what the last encoding decodes to
    _residual: jax.Array | None = field(default=None, repr=False)
    _zero: jax.Array = field(default_factory=lambda: jnp.zeros((), jnp.uint32), repr=False)

    def __post_init__(self) -> None:
        if not supports(self.codec):
            raise ValueError(f"codec {self.codec.name} has no encoder on the device")

    @property
    def residual(self) -> np.ndarray | None:
        return None if self._residual is None else np.asarray(self._residual)

    @residual.setter
    def residual(self, value: np.ndarray | None) -> None:
        self._residual = None if value is None else jnp.asarray(value, jnp.float32)

    def _plan(self, size: int) -> _Plan:
        step = segment_values(self.codec, self.block_size, self.chunk_bytes)
        return _Plan(
            size,
            self.block_size,
            LARGEST_CODE[self.codec.name],
            min(step, max(1, size)),  # one segment: no longer than the fragment
            self.tensor_sizes or (size,),
        )

    def encode(self, delta: Any) -> list[Segment]:
        """The delta (host or device values) plus the residual, encoded as segments."""
        delta = jnp.asarray(delta).reshape(-1)
        plan = self._plan(delta.size)
        if not plan.size:
            return self._finish(plan, None)
        return self._finish(plan, _feedback_on_delta(delta, self._residual, self._zero, plan))

    def encode_update(
        self, anchor: Sequence[jax.Array], theta: Sequence[jax.Array]
    ) -> list[Segment]:
        """The outer gradient anchor - theta (each a fragment's leaves in layout order, on
        the device) plus the residual, encoded as segments; nothing but the segments' bytes
        and the norms leaves the device."""
        plan = self._plan(sum(leaf.size for leaf in theta))
        if not plan.size:
            return self._finish(plan, None)
        out = _feedback_on_leaves(list(anchor), list(theta), self._residual, self._zero, plan)
        return self._finish(plan, out)

    def _finish(
        self, plan: _Plan, out: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None
    ) -> list[Segment]:
        if out is None:  # an empty fragment: one empty segment, as the host encodes it
            self.norms = tuple(0.0 for _ in plan.tensor_sizes)
            return [Segment(0, 0, b"")]
        scales, body, partials, residual = out
        host_scales, host_body, host_partials = jax.device_get((scales, body, partials))
        finite(host_scales)  # a diverged update is refused here, as the host encoder does
        self._residual = residual
        rows = np.cumsum([0] + [blocks_of(s, NORM_ROWS) for s in plan.tensor_sizes])
        squares = host_partials.astype(np.float64)
        self.norms = tuple(float(np.sqrt(squares[a:b].sum())) for a, b in itertools.pairwise(rows))
        int8 = plan.largest == LARGEST_CODE["int8"]
        segments = []
        for k, start in enumerate(range(0, plan.size, plan.step)):
            count = min(plan.step, plan.size - start)
            first = start // plan.block_size
            head = host_scales[first : first + blocks_of(count, plan.block_size)]
            codes = host_body[start : start + count] if int8 else host_body[k, : (count + 1) // 2]
            segments.append(Segment(start, count, head.astype("<f4").tobytes() + codes.tobytes()))
        return segments
