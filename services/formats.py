"""The wire formats below 4 bits a value, and topk: e3m0, int2, sign and topk, each its
encoder, and its decoder (services.blockwise decodes the first three at the synchronizer's
speed from a table of their codes' levels; topk decodes here). services.codec registers
them as codecs.
"""

from __future__ import annotations

import numpy as np

from services.blockwise import (
    Blockwise,
    CodecError,
    Payload,
    blocks_of,
    byte_table,
    check_block_size,
    scales_and_body,
    table_levels,
)


def _padded_blocks(x: np.ndarray, block_size: int) -> np.ndarray:
    """x (float32) padded with zeros into rows of block_size."""
    check_block_size(block_size)
    padded = np.zeros(blocks_of(x.size, block_size) * block_size, np.float32)
    padded[: x.size] = x
    return padded.reshape(-1, block_size)


def _block_counts(n: int, block_size: int) -> np.ndarray:
    """How many of each block's values are real (the last block may be short)."""
    counts = np.full(blocks_of(n, block_size), block_size, np.float32)
    if n:
        counts[-1] = n - (counts.size - 1) * block_size
    return counts


def _absmax_blocks(x: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """x padded into blocks, and each block's absmax (float32)."""
    blocks = _padded_blocks(x, block_size)
    return blocks, np.abs(blocks).max(axis=1).astype(np.float32)


def _pack_nibbles(codes: np.ndarray) -> bytes:
    """4-bit codes (0..15), two per byte, the first in the low nibble."""
    if codes.size % 2:
        codes = np.append(codes, 0)
    pairs = codes.astype(np.uint8).reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).astype(np.uint8).tobytes()


def _unpack_nibbles(packed: np.ndarray, n: int) -> np.ndarray:
    codes = np.empty(packed.size * 2, np.uint8)
    codes[0::2] = packed & 0x0F
    codes[1::2] = packed >> 4
    return codes[:n]


E3M0_MIN_EXP = -6  # magnitudes absmax * 2^e for e in -6..0, and zero


def encode_e3m0(x: np.ndarray, block_size: int) -> bytes:
    """Sign and a 3-bit exponent per value (Streaming DiLoCo's E3M0): |x| is rounded in the
    log domain to absmax * 2^e, e in -6..0, or to zero below half the smallest step.
    Code: bit 3 the sign, bits 0-2 the exponent e + 7 (0: zero)."""
    blocks, absmax = _absmax_blocks(np.asarray(x, np.float32), block_size)
    safe = np.where(absmax > 0, absmax, 1.0)[:, None]
    ratio = np.abs(blocks) / safe
    with np.errstate(divide="ignore"):
        e = np.rint(np.log2(np.maximum(ratio, 1e-30)))
    e = np.clip(e, E3M0_MIN_EXP, 0)
    zero = ratio < 2.0 ** (E3M0_MIN_EXP - 1)
    code = np.where(zero, 0, e - E3M0_MIN_EXP + 1).astype(np.uint8)
    code |= np.where(blocks < 0, 8, 0).astype(np.uint8)
    return absmax.astype("<f4").tobytes() + _pack_nibbles(code.ravel()[: x.size])


def _e3m0_levels() -> np.ndarray:
    """The 16 codes' values before the block's absmax: +-2^e, and +-0."""
    codes = np.arange(16)
    exp_code = (codes & 7).astype(np.float32)
    magnitude = np.where(exp_code > 0, np.exp2(exp_code + (E3M0_MIN_EXP - 1)), 0.0)
    return np.where(codes & 8, -magnitude, magnitude).astype(np.float32)


def encode_int2(x: np.ndarray, block_size: int) -> bytes:
    """Two bits a value, four levels (q - 1.5) * s for q in 0..3, s the block's root mean
    square (float32): uniform 2-bit quantization with the step that suits Gaussian values.
    Four codes a byte, the first in the lowest bits."""
    n = x.size
    blocks = _padded_blocks(np.asarray(x, np.float32), block_size)
    counts = _block_counts(n, block_size)
    scales = np.sqrt(np.square(blocks).sum(axis=1) / counts).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0)[:, None]
    q = np.clip(np.floor(blocks / safe) + 2, 0, 3).astype(np.uint8).ravel()[:n]
    q = np.append(q, np.zeros(-n % 4, np.uint8)).reshape(-1, 4)
    packed = (q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)).astype(np.uint8)
    return bytes(scales.astype("<f4").tobytes() + packed.tobytes())


def encode_sign(x: np.ndarray, block_size: int) -> bytes:
    """One bit a value: its sign, times its block's mean magnitude (the scale that makes a
    block's encoding closest to it), float32. Bit set: positive; a value of zero is sent as
    positive, and error feedback takes the difference back."""
    x = np.asarray(x, np.float32)
    blocks = _padded_blocks(x, block_size)
    counts = _block_counts(x.size, block_size)
    scales = (np.abs(blocks).sum(axis=1) / counts).astype(np.float32)
    bits = np.packbits(x >= 0, bitorder="little")
    return bytes(scales.astype("<f4").tobytes() + bits.tobytes())


TOPK_SHARE = 32  # topk keeps the 1/32 largest values of each block


def _topk_layout(n: int, block_size: int) -> tuple[int, int, np.dtype[np.unsignedinteger]]:
    """Blocks, values kept per block, and the dtype of their offsets in the block."""
    check_block_size(block_size)
    kept = max(1, block_size // TOPK_SHARE)
    offset: np.dtype[np.unsignedinteger] = np.dtype("<u4")
    if block_size <= 1 << 8:
        offset = np.dtype("u1")
    elif block_size <= 1 << 16:
        offset = np.dtype("<u2")
    return blocks_of(n, block_size), kept, offset


def encode_topk(x: np.ndarray, block_size: int) -> bytes:
    """The largest 1/32 of each block's values by magnitude, in 4-bit: per block a scale
    (their absmax / 7, float32), their offsets in the block in increasing order, and their
    codes q + 8, q = round(value / scale) in -7..7. Every other value decodes to zero; error
    feedback sends it later, once it has grown into its block's largest."""
    blocks, _ = _absmax_blocks(np.asarray(x, np.float32), block_size)
    _, kept, offset = _topk_layout(x.size, block_size)
    where = np.sort(np.argpartition(-np.abs(blocks), kept - 1, axis=1)[:, :kept], axis=1)
    chosen = np.take_along_axis(blocks, where, axis=1)
    scales = (np.abs(chosen).max(axis=1) / 7.0).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0)[:, None]
    q = np.clip(np.rint(chosen / safe), -7, 7).astype(np.int8)
    return bytes(
        scales.astype("<f4").tobytes()
        + where.astype(offset).tobytes()
        + _pack_nibbles((q + 8).astype(np.uint8).ravel())
    )


def _topk_parts(
    payload: Payload, n: int, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Checked scales, offsets (blocks x kept) and codes of a topk payload."""
    nb, kept, offset = _topk_layout(n, block_size)
    offsets_len = offset.itemsize * nb * kept
    scales, body = scales_and_body(
        payload, n, block_size, offsets_len + (nb * kept + 1) // 2, "topk"
    )
    where = np.frombuffer(body[:offsets_len].tobytes(), offset).reshape(nb, kept)
    if (where >= block_size).any() or (np.diff(where.astype(np.int64), axis=1) <= 0).any():
        raise CodecError(
            "topk payload has offsets out of their block or not increasing; the payload is corrupt"
        )
    return scales, where, _unpack_nibbles(body[offsets_len:], nb * kept)


def check_topk(payload: Payload, n: int, block_size: int) -> None:
    _topk_parts(payload, n, block_size)


def decode_topk(payload: Payload, n: int, block_size: int) -> np.ndarray:
    scales, where, codes = _topk_parts(payload, n, block_size)
    nb = scales.size
    out = np.zeros((nb, block_size), np.float32)
    values = (codes.astype(np.float32) - 8.0).reshape(where.shape) * scales[:, None]
    np.put_along_axis(out, where.astype(np.intp), values, axis=1)
    decoded: np.ndarray = out.ravel()[:n]
    return decoded


E3M0 = Blockwise("e3m0", 2, 1.0, table_levels(byte_table(_e3m0_levels(), 2)))
INT2 = Blockwise("int2", 4, 1.5, table_levels(byte_table(np.arange(4, dtype=np.float32) - 1.5, 4)))
SIGN = Blockwise("sign", 8, 1.0, table_levels(byte_table(np.array([-1.0, 1.0], np.float32), 8)))
