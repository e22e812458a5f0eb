"""The compressed downlink: new global values travel as encoded deltas.

The synchronizer defines each version of a fragment as the previous version plus the decoded
delta it sends, segment by segment (`step_segment`), and learners rebuild it with the same
float32 addition (`apply_segment`), so both hold the same values bit for bit. What encoding
loses stays on the synchronizer as an error-feedback residual and goes out with the next
delta, so the global value follows the outer optimizer's within one quantum. A learner that
missed a delta, or just joined, takes a full copy instead.
"""

from __future__ import annotations

import numpy as np

from services import kernels
from services.blockwise import blocks_of, finite
from services.codec import (
    DEFAULT_MAX_CHUNK_BYTES,
    FLOAT32_TINY,
    SMALL_SCALE,
    Codec,
    Payload,
    Segment,
    segment_values,
)


def step_segment(
    theta: np.ndarray, want: np.ndarray, residual: np.ndarray, codec: Codec, block_size: int
) -> bytes:
    """In place over one segment: encode `want` (the move toward the outer step's target
    plus what earlier deltas lost), add what decodes to `theta`, keep the rest in
    `residual`. Returns the encoded segment."""
    data = codec.encode(want, block_size)
    decoded = codec.decode(data, want.size, block_size)
    np.add(theta, decoded, out=theta, dtype=np.float32)
    np.subtract(want, decoded, out=residual, dtype=np.float32)
    return data


def fused_step(
    total: np.ndarray,
    factor: float,
    trace: np.ndarray | None,
    momentum: float,
    lr: float,
    residual: np.ndarray,
    theta: np.ndarray,
    codec: Codec,
    block_size: int,
) -> Payload | None:
    """In place over one segment, in one compiled pass: the outer gradient `total * factor`,
    Nesterov SGD's move (its `trace` updated; None without momentum), then `step_segment`
    on that move plus `residual`. Bit for bit what computing them one after another in
    numpy gives (OuterOptimizer.move, step_segment). None for a codec or block size it has
    no compiled step for: the caller takes the numpy path. Raises CodecError, as the numpy
    path does, where the step's values are not finite (the merge is then given up)."""
    f, mu, neg_lr = np.float32(factor), np.float32(momentum), np.float32(-lr)
    no_trace = np.zeros(0, np.float32) if trace is None else trace
    if codec.float32_payload:
        out = np.empty(total.size, "<f4")
        kernels.fp32_step(total, f, no_trace, mu, neg_lr, residual, theta, out)
        finite(out)
        return out.view(np.uint8).data  # the encoded bytes in place: no copy
    if codec.uniform is None:
        return None
    largest, per_byte = codec.uniform.largest, codec.uniform.per_byte
    if block_size % per_byte:
        return None
    nb = blocks_of(total.size, block_size)
    out = np.empty(4 * nb + -(-total.size // per_byte), np.uint8)
    kernels.uniform_step(
        total,
        f,
        no_trace,
        mu,
        neg_lr,
        residual,
        theta,
        out[: 4 * nb].view("<f4"),
        out[4 * nb :],
        block_size,
        largest,
        per_byte,
        np.float32(1 / largest),
        FLOAT32_TINY,
        SMALL_SCALE,
    )
    finite(out[: 4 * nb].view("<f4"))  # a NaN or Inf value makes its block's scale one
    return out.data


def apply_segment(
    base: np.ndarray, out: np.ndarray, segment: Segment, codec: Codec, block_size: int
) -> None:
    """out[segment] = base[segment] + decode(segment), in float32, as the synchronizer did
    (in one compiled pass where the codec has one)."""
    if codec.decode_onto(base, out, segment, block_size):
        return
    end = segment.offset + segment.count
    decoded = codec.decode(segment.data, segment.count, block_size)
    np.add(base[segment.offset : end], decoded, out=out[segment.offset : end], dtype=np.float32)


def encode_delta(
    base: np.ndarray,
    target: np.ndarray,
    residual: np.ndarray | None,
    codec: Codec,
    block_size: int,
    chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> tuple[list[Segment], np.ndarray, np.ndarray]:
    """The whole move from `base` toward `target` plus `residual`, as segments; the new
    version as learners rebuild it; the residual to keep."""
    theta = np.array(base, np.float32)
    want = np.asarray(target, np.float32) - theta
    if residual is not None:
        want = want + residual
    kept = np.empty_like(want)
    step = segment_values(codec, block_size, chunk_bytes)
    segments = []
    for start in range(0, max(1, theta.size), step):
        s = slice(start, start + step)
        data = step_segment(theta[s], want[s], kept[s], codec, block_size)
        segments.append(Segment(start, theta[s].size, data))
    return segments, theta, kept


def apply_delta(
    base: np.ndarray, segments: list[Segment], codec: Codec, block_size: int
) -> np.ndarray:
    """The next version: `base + decode(segments)` in float32."""
    base32 = np.asarray(base, np.float32)
    out = np.empty_like(base32)
    for segment in segments:
        apply_segment(base32, out, segment, codec, block_size)
    return out
