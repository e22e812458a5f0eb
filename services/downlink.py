"""The compressed downlink: new global values travel as encoded deltas.

The synchronizer defines each version of a fragment as the previous version plus the decoded
delta it sends (`apply_delta`), and learners rebuild it with the same function, so both hold
the same float32 values bit for bit. What encoding loses stays on the synchronizer as an
error-feedback residual and goes out with the next delta (`encode_delta`), so the global
value follows the outer optimizer's within one quantum. A learner that missed a delta, or
just joined, takes a full copy instead.
"""

from __future__ import annotations

import numpy as np

from services.codec import Codec


def apply_delta(base: np.ndarray, payload: bytes, codec: Codec, block_size: int) -> np.ndarray:
    """The next version: `base + decode(payload)` in float32."""
    base32 = np.asarray(base, np.float32)
    decoded = codec.decode(payload, base32.size, block_size)
    version: np.ndarray = np.add(base32, decoded, dtype=np.float32)
    return version


def encode_delta(
    base: np.ndarray,
    target: np.ndarray,
    residual: np.ndarray | None,
    codec: Codec,
    block_size: int,
) -> tuple[bytes, np.ndarray, np.ndarray]:
    """Encode the move from `base` (the current version) toward `target` (the outer step's
    result) plus what earlier deltas lost. Returns the payload, the new version as every
    learner will rebuild it, and the residual to keep."""
    base32 = np.asarray(base, np.float32)
    want = np.asarray(target, np.float32) - base32
    if residual is not None:
        want = want + residual
    payload = codec.encode(want, block_size)
    version = apply_delta(base32, payload, codec, block_size)
    return (
        payload,
        version,
        (want - codec.decode(payload, want.size, block_size)).astype(np.float32),
    )
