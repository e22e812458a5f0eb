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
    )
}
_BY_WIRE = {c.wire: c for c in REGISTRY.values()}


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
