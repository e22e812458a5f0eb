"""The codec registry: how a flat float32 vector becomes bytes on the wire and back.

Every codec is a pair of pure, vectorized numpy functions. Decoding checks the payload's
length against what the header promises and refuses non-finite values, so a corrupt or
hostile payload never reaches the merge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import xxhash

from services.gen.atoll.v1 import fragment_pb2

DEFAULT_BLOCK_SIZE = 256
MAX_BLOCK_SIZE = 1 << 20


class CodecError(ValueError):
    """A payload or codec parameter is invalid; the message says what and what to do."""


def checksum(payload: bytes | memoryview) -> int:
    """XXH3-64 of an encoded payload: catches corruption at several GB/s, where CRC-32
    costs as much CPU as the rest of the synchronizer's admission path."""
    return int(xxhash.xxh3_64_intdigest(payload))


def _blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def _check_block_size(block_size: int) -> None:
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise CodecError(
            f"block_size {block_size} is out of range; use 1..{MAX_BLOCK_SIZE} "
            f"(default {DEFAULT_BLOCK_SIZE})"
        )


def _expect_len(payload: bytes, expected: int, what: str) -> None:
    if len(payload) != expected:
        raise CodecError(
            f"{what} payload is {len(payload)} bytes, expected {expected} for the values "
            "announced in its header; the header or the payload is corrupt"
        )


def _finite(values: np.ndarray) -> np.ndarray:
    if not np.isfinite(values).all():
        raise CodecError("payload holds NaN or Inf values; the learner's update diverged")
    return values


def _encode_fp32(x: np.ndarray, _: int) -> bytes:
    return np.ascontiguousarray(x, "<f4").tobytes()


def _decode_fp32(payload: bytes, n: int, _: int) -> np.ndarray:
    _expect_len(payload, 4 * n, "fp32")
    return _finite(np.frombuffer(payload, "<f4").astype(np.float32))


def _encode_bf16(x: np.ndarray, _: int) -> bytes:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).tobytes()


def _decode_bf16(payload: bytes, n: int, _: int) -> np.ndarray:
    _expect_len(payload, 2 * n, "bf16")
    return _finite(np.frombuffer(payload, ml_dtypes.bfloat16).astype(np.float32))


def _int8_scales(x: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    n = x.size
    padded = np.zeros(_blocks(n, block_size) * block_size, np.float32)
    padded[:n] = x
    blocks = padded.reshape(-1, block_size)
    scales = np.abs(blocks).max(axis=1) / 127.0
    return blocks, scales.astype(np.float32)


def _encode_int8(x: np.ndarray, block_size: int) -> bytes:
    _check_block_size(block_size)
    blocks, scales = _int8_scales(np.asarray(x, np.float32), block_size)
    safe = np.where(scales > 0, scales, 1.0)[:, None]
    q = np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8).ravel()[: x.size]
    return scales.astype("<f4").tobytes() + q.tobytes()


def _decode_int8(payload: bytes, n: int, block_size: int) -> np.ndarray:
    _check_int8(payload, n, block_size)
    nb = _blocks(n, block_size)
    scales = np.frombuffer(payload, "<f4", count=nb)
    q = np.frombuffer(payload, np.int8, offset=4 * nb, count=n)
    out = np.zeros(nb * block_size, np.float32)
    out[:n] = q
    decoded: np.ndarray = (out.reshape(nb, block_size) * scales[:, None]).ravel()[:n]
    return decoded


def _absmax_blocks(x: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """x padded into blocks, and each block's absmax (float32)."""
    _check_block_size(block_size)
    n = x.size
    padded = np.zeros(_blocks(n, block_size) * block_size, np.float32)
    padded[:n] = x
    blocks = padded.reshape(-1, block_size)
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


def _nibble_payload_len(n: int, block_size: int) -> int:
    return 4 * _blocks(n, block_size) + (n + 1) // 2


def _encode_int4(x: np.ndarray, block_size: int) -> bytes:
    """Blockwise uniform 4-bit: q = round(x / (absmax / 7)) in -7..7, stored as q + 8."""
    blocks, absmax = _absmax_blocks(np.asarray(x, np.float32), block_size)
    scales = absmax / 7.0
    safe = np.where(scales > 0, scales, 1.0)[:, None]
    q = np.clip(np.rint(blocks / safe), -7, 7).astype(np.int8).ravel()[: x.size]
    return scales.astype("<f4").tobytes() + _pack_nibbles((q + 8).astype(np.uint8))


def _decode_int4(payload: bytes, n: int, block_size: int) -> np.ndarray:
    _check_nibbles(payload, n, block_size, "int4")
    nb = _blocks(n, block_size)
    scales = np.frombuffer(payload, "<f4", count=nb)
    codes = _unpack_nibbles(np.frombuffer(payload, np.uint8, offset=4 * nb), n)
    out = np.zeros(nb * block_size, np.float32)
    out[:n] = codes.astype(np.float32) - 8.0
    decoded: np.ndarray = (out.reshape(nb, block_size) * scales[:, None]).ravel()[:n]
    return decoded


E3M0_MIN_EXP = -6  # magnitudes absmax * 2^e for e in -6..0, and zero


def _encode_e3m0(x: np.ndarray, block_size: int) -> bytes:
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


def _decode_e3m0(payload: bytes, n: int, block_size: int) -> np.ndarray:
    _check_nibbles(payload, n, block_size, "e3m0")
    nb = _blocks(n, block_size)
    absmax = np.frombuffer(payload, "<f4", count=nb)
    codes = _unpack_nibbles(np.frombuffer(payload, np.uint8, offset=4 * nb), n)
    exp_code = (codes & 7).astype(np.float32)
    magnitude = np.where(exp_code > 0, np.exp2(exp_code + (E3M0_MIN_EXP - 1)), 0.0)
    signed = np.where(codes & 8, -magnitude, magnitude).astype(np.float32)
    out = np.zeros(nb * block_size, np.float32)
    out[:n] = signed
    decoded: np.ndarray = (out.reshape(nb, block_size) * absmax[:, None]).ravel()[:n]
    return decoded


def _check_nibbles(payload: bytes, n: int, block_size: int, what: str) -> None:
    _check_block_size(block_size)
    _expect_len(payload, _nibble_payload_len(n, block_size), what)
    scales = _finite(np.frombuffer(payload, "<f4", count=_blocks(n, block_size)))
    if (scales < 0).any():
        raise CodecError(f"{what} payload has a negative block scale; the payload is corrupt")


def _check_float(itemsize: int, dtype: object, what: str) -> Callable[[bytes, int, int], None]:
    def check(payload: bytes, n: int, _: int) -> None:
        _expect_len(payload, itemsize * n, what)
        _finite(np.frombuffer(payload, dtype))  # type: ignore[call-overload]

    return check


def _check_int8(payload: bytes, n: int, block_size: int) -> None:
    _check_block_size(block_size)
    nb = _blocks(n, block_size)
    _expect_len(payload, 4 * nb + n, "int8")
    scales = _finite(np.frombuffer(payload, "<f4", count=nb))
    if (scales < 0).any():
        raise CodecError("int8 payload has a negative block scale; the payload is corrupt")


@dataclass(frozen=True)
class Codec:
    name: str
    wire: int  # fragment_pb2.Codec value
    encode: Callable[[np.ndarray, int], bytes]
    decode: Callable[[bytes, int, int], np.ndarray]
    # Validates length, parameters and finiteness without building the decoded array: the
    # synchronizer runs it on every update it admits.
    check: Callable[[bytes, int, int], None]


REGISTRY: dict[str, Codec] = {
    c.name: c
    for c in (
        Codec(
            "fp32",
            fragment_pb2.CODEC_FP32,
            _encode_fp32,
            _decode_fp32,
            _check_float(4, "<f4", "fp32"),
        ),
        Codec(
            "bf16",
            fragment_pb2.CODEC_BF16,
            _encode_bf16,
            _decode_bf16,
            _check_float(2, ml_dtypes.bfloat16, "bf16"),
        ),
        Codec("int8", fragment_pb2.CODEC_INT8, _encode_int8, _decode_int8, _check_int8),
        Codec(
            "int4-uniform",
            fragment_pb2.CODEC_INT4,
            _encode_int4,
            _decode_int4,
            lambda p, n, b: _check_nibbles(p, n, b, "int4"),
        ),
        Codec(
            "e3m0",
            fragment_pb2.CODEC_E3M0,
            _encode_e3m0,
            _decode_e3m0,
            lambda p, n, b: _check_nibbles(p, n, b, "e3m0"),
        ),
    )
}
_BY_WIRE = {c.wire: c for c in REGISTRY.values()}
# `--codec int4`: the 4-bit codec that measured better (docs/BENCHMARKS.md, 4-bit codecs).
INT4_DEFAULT = "int4-uniform"
REGISTRY["int4"] = REGISTRY[INT4_DEFAULT]


def by_name(name: str) -> Codec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; choose one of {sorted(REGISTRY)}") from None


def by_wire(value: int) -> Codec:
    try:
        return _BY_WIRE[value]
    except KeyError:
        raise CodecError(
            f"codec number {value} is not supported by this synchronizer; "
            f"supported: {sorted(REGISTRY)}"
        ) from None


@dataclass
class ErrorFeedback:
    """Per-fragment encoding residual: what the last encoding lost is added to the next.

    The sum of everything decoded stays within one quantum of the sum of true deltas.
    """

    codec: Codec
    block_size: int
    residual: np.ndarray | None = None

    def encode(self, delta: np.ndarray) -> bytes:
        corrected = delta if self.residual is None else delta + self.residual
        payload = self.codec.encode(corrected, self.block_size)
        self.residual = corrected - self.codec.decode(payload, corrected.size, self.block_size)
        return payload
