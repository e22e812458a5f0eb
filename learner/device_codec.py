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

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from services.blockwise import blocks_of, finite
from services.codec import (
    DEFAULT_MAX_CHUNK_BYTES,
    FLOAT32_TINY,
    UNIFORM_CODES,
    Codec,
    Segment,
    segment_values,
)

# Codecs encoded on the device: the largest code of each uniform quantizer.
LARGEST_CODE = {name: largest for name, (largest, _) in UNIFORM_CODES.items()}


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


@dataclass(frozen=True)
class _Plan:
    """What one fragment's encoding compiles for."""

    size: int
    block_size: int
    largest: int
    step: int  # values a segment
    tensor_sizes: tuple[int, ...]

    @property
    def blocks(self) -> int:
        return blocks_of(self.size, self.block_size)

    @property
    def segments(self) -> int:
        return max(1, blocks_of(self.size, self.step))

    @property
    def packs_whole(self) -> bool:
        """Whether int4's pairs never straddle a segment (even blocks): then the codes are
        packed in one piece, and each segment's bytes are a slice of it."""
        return self.block_size % 2 == 0

    def pieces(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, list[int]]]]:
        """How each tensor's sum of squares is read from the blocks' sums: the pieces of
        blocks a tensor shares with another, as (block, first, end) offsets in it, and per
        tensor (first whole block, end, its pieces' indexes)."""
        pieces: list[tuple[int, int, int]] = []
        tensors = []
        start = 0
        bs = self.block_size
        for size in self.tensor_sizes:
            end = start + size
            first_whole, end_whole = -(-start // bs), end // bs
            mine = []
            if first_whole > end_whole:  # inside one block
                mine.append(len(pieces))
                pieces.append((start // bs, start % bs, end % bs))
                first_whole = end_whole = 0
            else:
                if start % bs:
                    mine.append(len(pieces))
                    pieces.append((start // bs, start % bs, bs))
                if end % bs:
                    mine.append(len(pieces))
                    pieces.append((end // bs, 0, end % bs))
            tensors.append((first_whole, end_whole, mine))
            start = end
        return pieces, tensors


def _unfused(x: jax.Array, zero: jax.Array) -> jax.Array:
    """x, through an integer XOR with a zero known only at run time: no FMA can take in
    the product that made x."""
    bits = lax.bitcast_convert_type(x, jnp.uint32) ^ zero
    return lax.bitcast_convert_type(bits, jnp.float32)


def _body(codes: jax.Array, plan: _Plan) -> jax.Array:
    """The codes (blocks x block_size) as the payloads' bytes: int8, one a byte; int4,
    q + 8 two a byte (the first in the low nibble): packed whole (`packs_whole`: an odd
    last segment's high nibble is cleared on the host), else each segment on its own
    (segments x bytes)."""
    if plan.largest == LARGEST_CODE["int8"]:
        return codes.reshape(-1).astype(jnp.int8)
    if plan.packs_whole:
        pairs = (codes + 8).astype(jnp.uint8).reshape(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)
    nibbles = (codes.reshape(-1)[: plan.size] + 8).astype(jnp.uint8)
    rows = jnp.pad(nibbles, (0, plan.segments * plan.step - plan.size))
    rows = rows.reshape(plan.segments, plan.step)
    if plan.step % 2:
        rows = jnp.pad(rows, ((0, 0), (0, 1)))
    pairs = rows.reshape(plan.segments, -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _feedback(
    corrected: jax.Array, zero: jax.Array, plan: _Plan
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """One encoding of `corrected` (blocks x block_size, zeros past the values): the
    scales, the body, the blocks' sums of squares of what it decodes to and those of the
    pieces of blocks tensors share, and the new residual (blocked as `corrected`)."""
    blocks = _flush_tiny(corrected)
    scales = _flush_tiny(jnp.max(jnp.abs(blocks), axis=1) * jnp.float32(1 / plan.largest))
    codes = jnp.round(blocks * reciprocal(scales)[:, None])  # to nearest, ties to even
    codes = jnp.clip(codes, -plan.largest, plan.largest)
    decoded = _unfused(codes * scales[:, None], zero)
    squares = decoded * decoded
    pieces, _ = plan.pieces()
    if pieces:  # the blocks tensors share, each masked to its piece: one gather, one sum
        block, first, end = (np.array(column, np.int32) for column in zip(*pieces, strict=True))
        column = lax.broadcasted_iota(jnp.int32, (len(pieces), plan.block_size), 1)
        inside = (column >= first[:, None]) & (column < end[:, None])
        shared = jnp.sum(jnp.where(inside, squares[block], 0), axis=1)
    else:
        shared = jnp.zeros(0, jnp.float32)
    return scales, _body(codes, plan), jnp.sum(squares, axis=1), shared, corrected - decoded


def _blocked(flat: list[jax.Array], plan: _Plan) -> jax.Array:
    """Flat float32 pieces end to end, padded with zeros to whole blocks."""
    tail = plan.blocks * plan.block_size - plan.size
    parts = [*flat, jnp.zeros(tail, jnp.float32)] if tail else flat
    joined = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    return joined.reshape(plan.blocks, plan.block_size)


@partial(jax.jit, static_argnames="plan")
def _feedback_on_delta(
    delta: jax.Array, residual: jax.Array, zero: jax.Array, plan: _Plan
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    return _feedback(_blocked([delta.astype(jnp.float32)], plan) + residual, zero, plan)


@partial(jax.jit, static_argnames="plan")
def _feedback_on_leaves(
    anchor: list[jax.Array],
    theta: list[jax.Array],
    residual: jax.Array,
    zero: jax.Array,
    plan: _Plan,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    differences = [
        a.reshape(-1).astype(jnp.float32) - t.reshape(-1).astype(jnp.float32)
        for a, t in zip(anchor, theta, strict=True)
    ]
    return _feedback(_blocked(differences, plan) + residual, zero, plan)


def encode(codec: Codec, x: Any, block_size: int) -> bytes:
    """One payload encoded on the device: codec.encode(x, block_size), bit for bit."""
    feedback = DeviceFeedback(codec, block_size, chunk_bytes=1 << 62)
    (segment,) = feedback.encode(x)
    return bytes(segment.data)  # bytes already: no copy


@dataclass
class DeviceFeedback:
    """services.codec.ErrorFeedback on the learner's device: the same segments, bit for
    bit, for the codecs `supports` names. The residual stays on the device; `residual`
    copies it to the host (a checkpoint) and takes one back (a restore)."""

    codec: Codec
    block_size: int
    chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES  # encoded bytes per segment, at most
    tensor_sizes: tuple[int, ...] = ()  # the fragment's tensors, for `norms`
    norms: tuple[float, ...] = ()  # each tensor's L2 norm of what the last encoding decodes to
    _residual: jax.Array | None = field(default=None, repr=False)  # blocked, zeros past _size
    _size: int = field(default=0, repr=False)
    _zero: jax.Array = field(default_factory=lambda: jnp.zeros((), jnp.uint32), repr=False)

    def __post_init__(self) -> None:
        if not supports(self.codec):
            raise ValueError(f"codec {self.codec.name} has no encoder on the device")

    @property
    def residual(self) -> np.ndarray | None:
        if self._residual is None:
            return None
        return np.asarray(self._residual).reshape(-1)[: self._size]

    @residual.setter
    def residual(self, value: np.ndarray | None) -> None:
        if value is None:
            self._residual = None
            return
        flat = np.asarray(value, np.float32).reshape(-1)
        self._size = flat.size
        tail = blocks_of(flat.size, self.block_size) * self.block_size - flat.size
        blocked = np.pad(flat, (0, tail)).reshape(-1, self.block_size)
        self._residual = jnp.asarray(blocked)

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
        out = _feedback_on_delta(delta, self._residual_for(plan, delta), self._zero, plan)
        return self._finish(plan, out)

    def encode_update(
        self, anchor: Sequence[jax.Array], theta: Sequence[jax.Array]
    ) -> list[Segment]:
        """The outer gradient anchor - theta (each a fragment's leaves in layout order, on
        the device) plus the residual, encoded as segments; nothing but the segments' bytes
        and the norms leaves the device."""
        plan = self._plan(sum(leaf.size for leaf in theta))
        if not plan.size:
            return self._finish(plan, None)
        residual = self._residual_for(plan, theta[0])
        out = _feedback_on_leaves(list(anchor), list(theta), residual, self._zero, plan)
        return self._finish(plan, out)

    def warm(self, leaves: Sequence[jax.Array]) -> None:
        """Compile the encoder of a fragment of these leaves (its anchor, say) now, with no
        change to this feedback's state: its first update then encodes at once."""
        plan = self._plan(sum(leaf.size for leaf in leaves))
        if plan.size:
            residual = self._residual_for(plan, leaves[0])
            _feedback_on_leaves(list(leaves), list(leaves), residual, self._zero, plan)

    def _residual_for(self, plan: _Plan, like: jax.Array) -> jax.Array:
        """The residual; before the first encoding, zeros placed as `like` (an input) is:
        one compiled encoder a fragment, where a first call without a residual compiled
        another (adding zeros changes no byte: a zero's sign reaches no code or residual)."""
        if self._residual is None:
            shape = (plan.blocks, plan.block_size)
            return jnp.zeros(shape, jnp.float32, device=like.sharding)
        return self._residual

    def _finish(
        self,
        plan: _Plan,
        out: tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array] | None,
    ) -> list[Segment]:
        if out is None:  # an empty fragment: one empty segment, as the host encodes it
            self.norms = tuple(0.0 for _ in plan.tensor_sizes)
            return [Segment(0, 0, b"")]
        scales, body, block_squares, shared_squares, residual = out
        host_scales, host_body, blocks, shared = jax.device_get(
            (scales, body, block_squares, shared_squares)
        )
        finite(host_scales)  # a diverged update is refused here, as the host encoder does
        self._residual, self._size = residual, plan.size
        self.norms = _norms(plan, blocks, shared)
        int8 = plan.largest == LARGEST_CODE["int8"]
        segments = []
        for k, start in enumerate(range(0, plan.size, plan.step)):
            count = min(plan.step, plan.size - start)
            first = start // plan.block_size
            head = host_scales[first : first + blocks_of(count, plan.block_size)]
            if int8:
                codes = host_body[start : start + count]
            elif plan.packs_whole:
                codes = host_body[start // 2 : (start + count + 1) // 2]
                if count % 2:  # the last code's partner is padding: its nibble is 0
                    codes = codes.copy()
                    codes[-1] &= 0x0F
            else:
                codes = host_body[k, : (count + 1) // 2]
            segments.append(Segment(start, count, head.astype("<f4").tobytes() + codes.tobytes()))
        return segments


def _norms(plan: _Plan, blocks: np.ndarray, shared: np.ndarray) -> tuple[float, ...]:
    """Each tensor's L2 norm from the blocks' sums of squares and those of the pieces of
    blocks tensors share, added in float64 (a float32 sum of millions of squares drifts)."""
    _, tensors = plan.pieces()
    wide, pieces = blocks.astype(np.float64), shared.astype(np.float64)
    return tuple(
        float(np.sqrt(wide[first:end].sum() + pieces[mine].sum())) for first, end, mine in tensors
    )
