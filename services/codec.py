"""The codec registry: how a flat float32 vector becomes bytes on the wire and back.

Every codec is a pair of pure, vectorized numpy functions. Decoding checks the payload's
length against what the header promises and refuses non-finite values, so a corrupt or
hostile payload never reaches the merge. The blockwise codecs (per-block scales, then packed
codes) decode through services.blockwise, at the synchronizer's speed.

int8 and int4 encode with multiplications by correctly rounded reciprocals, and count values
below float32's smallest normal as zero: that is what an accelerator computes exactly (XLA
divides approximately on GPUs, by a constant through its reciprocal, and flushes such
values), so learner.device_codec encodes them on the learner's device to the same bytes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import xxhash

from services import formats, kernels
from services.blockwise import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE
from services.blockwise import (
    FLOAT32_MAX,
    INT8_FUSED,
    NIBBLE_FUSED,
    Blockwise,
    blocks_of,
    check_block_size,
    check_limit,
    check_squares,
    expect_len,
    finite,
    int8_levels,
    offset_nibble_levels,
    scale_blocks,
    target,
)
from services.blockwise import MAX_BLOCK_SIZE as MAX_BLOCK_SIZE
from services.blockwise import CodecError as CodecError
from services.blockwise import OverSquares as OverSquares
from services.blockwise import Payload as Payload
from services.blockwise import Ready as Ready
from services.gen.atoll.v1 import fragment_pb2

FLOAT32_TINY = np.float32(np.finfo(np.float32).tiny)  # the smallest normal float32


def checksum(payload: bytes | memoryview) -> int:
    """XXH3-64 of an encoded payload: catches corruption at several GB/s, where CRC-32
    costs as much CPU as the rest of the synchronizer's admission path."""
    return int(xxhash.xxh3_64_intdigest(payload))


def _encode_fp32(x: np.ndarray, _: int) -> bytes:
    return np.ascontiguousarray(x, "<f4").tobytes()


def _decode_fp32(payload: Payload, n: int, _: int) -> np.ndarray:
    expect_len(payload, 4 * n, "fp32")
    return finite(np.frombuffer(payload, "<f4").astype(np.float32))


def _encode_bf16(x: np.ndarray, _: int) -> bytes:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).tobytes()


def _decode_bf16(payload: Payload, n: int, _: int) -> np.ndarray:
    expect_len(payload, 2 * n, "bf16")
    return finite(np.frombuffer(payload, ml_dtypes.bfloat16).astype(np.float32))


# Values encoded a chunk (whole blocks, an even number): their float32 values stay in cache.
ENCODE_CHUNK = 1 << 16
# Only a block's scale below this lets a value under float32's smallest normal round to a
# nonzero code (|value * (1 / scale)| >= 1/2): such blocks are encoded again, flushed.
SMALL_SCALE = np.float32(2.0**-124)


@dataclass(frozen=True)
class Uniform:
    """A blockwise uniform quantizer's codes (`uniform_payload`): -largest..largest, per_byte
    of them a byte. A codec of such codes encodes on the learner's device too
    (learner.device_codec), and in the synchronizer's compiled outer step (services.downlink)."""

    largest: int
    per_byte: int

    def encode(self, x: np.ndarray, block_size: int) -> bytes:
        return uniform_payload(x, block_size, self.largest, self.per_byte)


def uniform_payload(x: np.ndarray, block_size: int, largest: int, per_byte: int) -> bytes:
    """Blockwise uniform quantization to codes -largest..largest, as a payload of the
    blocks' float32 scales then the codes (int8: one signed byte each; 4-bit: q + 8, two a
    byte, the first in the low nibble).

    The definition, which learner.device_codec computes on an accelerator to the same bytes:
    values below float32's smallest normal count as zero; a block's scale is its absmax
    times float32(1 / largest), zero if below the smallest normal; a value's code is
    rint(value * (1 / scale)) (the reciprocal correctly rounded, ties to even), clipped,
    and 0 where the scale is. Worked a chunk at a time, in cache."""
    check_block_size(block_size)
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    n, nb = x.size, blocks_of(x.size, block_size)
    out = np.empty(4 * nb + -(-n // per_byte), np.uint8)
    scales, body = out[: 4 * nb].view("<f4"), out[4 * nb :]
    step = max(1, ENCODE_CHUNK // (2 * block_size)) * 2 * block_size
    buf = np.empty(min(step, n), np.float32)
    packed = np.empty(min(step, n) // 2 + 1, "<u2")
    inverse = np.float32(1 / largest)
    for start in range(0, n, step):
        chunk = x[start : start + step]
        m, full, first = chunk.size, chunk.size // block_size, start // block_size
        mag = np.abs(chunk, out=buf[:m])
        scale = scales[first : first + blocks_of(m, block_size)]
        np.max(mag[: full * block_size].reshape(full, block_size), axis=1, out=scale[:full])
        if full < scale.size:
            scale[full] = mag[full * block_size :].max()
        np.multiply(scale, inverse, out=scale)
        scale[scale < FLOAT32_TINY] = 0
        recip = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
        codes = buf[:m]
        scale_blocks(chunk, recip, block_size, codes)
        for b in np.flatnonzero((scale > 0) & (scale < SMALL_SCALE)):
            values = chunk[b * block_size : (b + 1) * block_size]
            tiny = np.where(np.abs(values) < FLOAT32_TINY, np.float32(0), values)
            np.multiply(tiny, recip[b], out=codes[b * block_size : (b + 1) * block_size])
        np.clip(np.rint(codes, out=codes), -largest, largest, out=codes)
        if per_byte == 1:
            np.copyto(body[start : start + m].view(np.int8), codes, casting="unsafe")
            continue
        nibbles = packed.view(np.uint8)[: m + m % 2]
        np.add(codes, 8, out=codes)
        np.copyto(nibbles[:m], codes, casting="unsafe")
        nibbles[m:] = 0  # an odd count's last byte: its high nibble is 0
        pairs = packed[: nibbles.size // 2]
        high = np.right_shift(pairs, 4)
        np.bitwise_and(high, 0xF0, out=high)
        np.bitwise_and(pairs, 0x0F, out=pairs)
        np.bitwise_or(pairs, high, out=pairs)
        np.copyto(body[start // 2 : start // 2 + pairs.size], pairs, casting="unsafe")
    return out.tobytes()


def _check_float(itemsize: int, dtype: object, what: str) -> Callable[[Payload, int, int], None]:
    def check(payload: Payload, n: int, _: int) -> None:
        expect_len(payload, itemsize * n, what)
        finite(np.frombuffer(payload, dtype))  # type: ignore[call-overload]

    return check


@dataclass(frozen=True)
class Codec:
    """One wire format of a flat float32 vector, and every fact about it the services read:
    its name and proto enum value, its functions, and what compiled paths it has."""

    name: str
    wire: int  # fragment_pb2.Codec value
    encode: Callable[[np.ndarray, int], bytes]
    decode: Callable[[Payload, int, int], np.ndarray]
    # Validates length, parameters and finiteness without building the decoded array: the
    # synchronizer runs it on every update it admits.
    check: Callable[[Payload, int, int], None]
    blockwise: Blockwise | None = None  # per-block scales then packed codes
    # The payload is the values themselves (little-endian float32): summed and moved where
    # they lie, not decoded into a copy first.
    float32_payload: bool = False
    uniform: Uniform | None = None  # blockwise uniform codes: encoded on devices too
    about: str = ""  # what a value becomes, in a few words (the docs' table of codecs)

    @classmethod
    def of_blocks(
        cls,
        name: str,
        wire: int,
        encode: Callable[[np.ndarray, int], bytes],
        blockwise: Blockwise,
        about: str = "",
        uniform: Uniform | None = None,
    ) -> Codec:
        decode, check = blockwise.decode, blockwise.check
        return cls(name, wire, encode, decode, check, blockwise, False, uniform, about)

    @classmethod
    def of_uniform(
        cls, name: str, wire: int, codes: Uniform, blockwise: Blockwise, about: str
    ) -> Codec:
        return cls.of_blocks(name, wire, codes.encode, blockwise, about, codes)

    def decode_onto(
        self, base: np.ndarray, out: np.ndarray, segment: Segment, block_size: int
    ) -> bool:
        """out[segment] = base[segment] + the segment decoded, in float32 (what decoding, then
        np.add give, bit for bit), in one compiled pass (Blockwise.decode_onto); False,
        nothing written, where the codec has none (the caller decodes, then adds)."""
        if self.blockwise is None:
            return False
        return self.blockwise.decode_onto(
            base, out, segment.offset, segment.count, segment.data, block_size
        )

    def move_into(
        self, src: np.ndarray, dst: np.ndarray, weight: float, segment: Segment, block_size: int
    ) -> bool:
        """A segment `decode_into` added into `src` at `weight` moves to `dst` in one pass
        (Blockwise.move_into); False, nothing done, where no compiled path exists: the
        caller decodes it into each."""
        if self.float32_payload:
            values = self._float32_values(segment)
            src_part = target(src, segment.offset, segment.count, self.name)
            dst_part = target(dst, segment.offset, segment.count, self.name)
            kernels.float32_move(src_part, dst_part, np.float32(weight), values)
            return True
        if self.blockwise is None:
            return False
        return self.blockwise.move_into(
            src, dst, weight, segment.offset, segment.count, segment.data, block_size
        )

    def decode_into(
        self,
        acc: np.ndarray,
        weight: float,
        segment: Segment,
        block_size: int,
        limit: float = FLOAT32_MAX,
        max_squares: float = math.inf,
    ) -> float:
        """acc[segment.offset : segment.offset + segment.count] += float32(weight) times the
        segment's decoded values, bit for bit what decoding, then multiplying by the weight
        and adding in float32 give (the synchronizer's accumulator), without building the
        decoded segment for blockwise codecs. Returns the decoded values' sum of squares.
        Raises CodecError, with `acc` untouched, for a payload `check` refuses, a segment
        outside `acc`, or values that times the weight could pass `limit` in magnitude; and
        OverSquares, `acc` untouched, for values whose sum of squares passes `max_squares`
        (an update's norm bound: refused before anything is added, never taken out again)."""
        if self.blockwise is not None:
            return self.blockwise.decode_into(
                acc,
                weight,
                segment.offset,
                segment.count,
                segment.data,
                block_size,
                limit,
                max_squares,
            )
        part = target(acc, segment.offset, segment.count, self.name)
        if self.float32_payload:
            values = self._float32_values(segment)
            # NaN and Inf pass neither bound: one check for both, and no copy of |values|.
            largest = max(float(values.max()), -float(values.min())) if values.size else 0.0
            if not np.isfinite(largest):
                raise CodecError("payload holds NaN or Inf values; the learner's update diverged")
            check_limit(largest, weight, limit, self.name)
            squares = kernels.float32_squares(values)  # numpy's dot copies unaligned values
        else:
            values, squares = self.decode_checked(segment, block_size, weight, limit)
        check_squares(squares, max_squares)
        kernels.add_weighed(part, values, np.float32(weight))
        return squares

    def ready(
        self,
        acc: np.ndarray,
        weight: float,
        segment: Segment,
        block_size: int,
        limit: float = FLOAT32_MAX,
        max_squares: float = math.inf,
    ) -> Ready | None:
        """A segment checked as `decode_into` checks it before adding anything, to be summed
        with other segments of its range by `decode_many`; CodecError as `decode_into`
        raises it. None where it goes alone through `decode_into` (Blockwise.ready)."""
        if self.blockwise is None:
            return None
        return self.blockwise.ready(
            acc,
            weight,
            segment.offset,
            segment.count,
            segment.data,
            block_size,
            limit,
            max_squares,
        )

    def decode_many(
        self, acc: np.ndarray, offset: int, count: int, block_size: int, chunks: list[Ready]
    ) -> list[float]:
        """`decode_into` of each `ready` segment of one range in turn, bit for bit, reading
        and writing the sum once for several (Blockwise.decode_many); their sums of squares."""
        assert self.blockwise is not None, "decode_many of a codec without ready segments"
        return self.blockwise.decode_many(acc, offset, count, block_size, chunks)

    def decode_checked(
        self, segment: Segment, block_size: int, weight: float, limit: float = FLOAT32_MAX
    ) -> tuple[np.ndarray, float]:
        """A segment decoded whole (an array of its own, to scale in place) and its sum of
        squares in float64; CodecError for values that times `weight` could pass `limit`."""
        values = self.decode(segment.data, segment.count, block_size)
        check_limit(float(np.abs(values).max()) if values.size else 0.0, weight, limit, self.name)
        return values, kernels.float32_squares(values)

    def _float32_values(self, segment: Segment) -> np.ndarray:
        """The segment's values where its payload lies (a float32_payload codec's)."""
        expect_len(segment.data, 4 * segment.count, self.name)
        return np.frombuffer(segment.data, "<f4")


# Every codec by each name it answers to, in the order `--codec` offers them: the config's
# choices, the Helm schema's enum and the docs' table all follow from it (`register`).
REGISTRY: dict[str, Codec] = {}
_BY_WIRE: dict[int, Codec] = {}


def register(codec: Codec, *aliases: str) -> Codec:
    """Add a codec, with other names it answers to (offered before its own): a new codec is
    its functions, one call of this, and its value in proto/'s Codec enum."""
    names = (*aliases, codec.name)
    taken = [n for n in names if n in REGISTRY] + [str(codec.wire)] * (codec.wire in _BY_WIRE)
    if taken:
        raise ValueError(f"codec {codec.name!r}: {', '.join(taken)} already registered")
    for name in names:
        REGISTRY[name] = codec
    _BY_WIRE[codec.wire] = codec
    return codec


register(
    Codec(
        "fp32",
        fragment_pb2.CODEC_FP32,
        _encode_fp32,
        _decode_fp32,
        _check_float(4, "<f4", "fp32"),
        float32_payload=True,
        about="the float32 values themselves, little-endian",
    )
)
register(
    Codec(
        "bf16",
        fragment_pb2.CODEC_BF16,
        _encode_bf16,
        _decode_bf16,
        _check_float(2, ml_dtypes.bfloat16, "bf16"),
        about="bfloat16, rounded to nearest even",
    )
)
register(
    Codec.of_uniform(
        "int8",
        fragment_pb2.CODEC_INT8,
        Uniform(127, 1),
        # Codes -127..127 are written; a payload's -128 decodes too, so bounds use 128.
        Blockwise("int8", 1, 128.0, int8_levels, INT8_FUSED),
        "per-block absmax scales, values -127..127",
    )
)
# `--codec int4`: the 4-bit codec that measured better (docs/BENCHMARKS.md, 4-bit codecs).
INT4_DEFAULT = "int4-uniform"
register(
    Codec.of_uniform(
        INT4_DEFAULT,
        fragment_pb2.CODEC_INT4,
        Uniform(7, 2),
        Blockwise("int4", 2, 8.0, offset_nibble_levels, NIBBLE_FUSED),
        "per-block absmax scales, values -7..7",
    ),
    "int4",
)
register(
    Codec.of_blocks(
        "e3m0",
        fragment_pb2.CODEC_E3M0,
        formats.encode_e3m0,
        formats.E3M0,
        "sign and 3-bit exponent per value, per-block absmax",
    )
)
register(
    Codec.of_blocks(
        "int2",
        fragment_pb2.CODEC_INT2,
        formats.encode_int2,
        formats.INT2,
        "four levels, (q - 1.5) x the block's root mean square",
    )
)
register(
    Codec.of_blocks(
        "sign",
        fragment_pb2.CODEC_SIGN,
        formats.encode_sign,
        formats.SIGN,
        "one bit a value, times the block's mean magnitude",
    )
)
register(
    Codec(
        "topk",
        fragment_pb2.CODEC_TOPK,
        formats.encode_topk,
        formats.decode_topk,
        formats.check_topk,
        about="each block's largest 1/32 by magnitude, their offsets and 4-bit values; the "
        "rest waits in the residual",
    )
)
# Each uniform codec's (largest code, codes a byte), by name: read from the registry.
UNIFORM_CODES = {
    c.name: (c.uniform.largest, c.uniform.per_byte) for c in REGISTRY.values() if c.uniform
}


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


# Encoded bytes a segment (one wire chunk each), at most: 4 MiB, half the 8 MiB message
# limit atoll's channels and servers set (services.grpcopts). Each chunk costs a replica's
# event loop about the same Python work whatever its size: at 1 MiB a replica took in 0.72x
# what it does at 4 MiB (`atoll bench synchronizer`, docs/BENCHMARKS.md, session 9).
DEFAULT_MAX_CHUNK_BYTES = 4 << 20


@dataclass
class ErrorFeedback:
    """Per-fragment encoding residual: what the last encoding lost is added to the next.

    The sum of everything decoded stays within one quantum of the sum of true deltas.
    """

    codec: Codec
    block_size: int
    residual: np.ndarray | None = None
    chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES  # encoded bytes per segment, at most
    tensor_sizes: tuple[int, ...] = ()  # the fragment's tensors, for `norms`
    norms: tuple[float, ...] = ()  # each tensor's L2 norm of what the last encoding decodes to

    def encode(self, delta: np.ndarray) -> list[Segment]:
        """The delta plus the residual, encoded as segments that decode on their own."""
        corrected = delta if self.residual is None else delta + self.residual
        segments, decoded = encode_segments(
            self.codec, corrected, self.block_size, self.chunk_bytes
        )
        self.residual = corrected - decoded
        starts = np.cumsum((0, *(self.tensor_sizes or (decoded.size,))))
        self.norms = tuple(
            float(np.linalg.norm(decoded[a:b].astype(np.float64)))
            for a, b in itertools.pairwise(starts)
        )
        return segments


@dataclass(frozen=True)
class Segment:
    """Values [offset, offset + count) of a fragment, encoded on their own: one wire chunk."""

    offset: int
    count: int
    data: Payload


def segment_values(codec: Codec, block_size: int, chunk_bytes: int) -> int:
    """Values per segment: whole blocks, as many as fit in `chunk_bytes` encoded bytes."""
    unit = max(1, block_size)
    per_unit = len(codec.encode(np.ones(unit, np.float32), block_size))
    return max(1, chunk_bytes // max(1, per_unit)) * unit


def encode_segments(
    codec: Codec, values: np.ndarray, block_size: int, chunk_bytes: int
) -> tuple[list[Segment], np.ndarray]:
    """`values` encoded segment by segment (each a whole number of blocks, so the result
    decodes to exactly what encoding the whole would), and the decoded values."""
    flat = np.ascontiguousarray(values, np.float32).reshape(-1)
    step = segment_values(codec, block_size, chunk_bytes)
    decoded = np.empty_like(flat)
    segments = []
    for start in range(0, max(1, flat.size), step):
        part = flat[start : start + step]
        data = codec.encode(part, block_size)
        decoded[start : start + part.size] = codec.decode(data, part.size, block_size)
        segments.append(Segment(start, part.size, data))
    return segments, decoded


def decode_segments(codec: Codec, segments: list[Segment], n: int, block_size: int) -> np.ndarray:
    """The float32 values of a whole fragment's segments (tests, tools)."""
    out = np.empty(n, np.float32)
    for s in segments:
        out[s.offset : s.offset + s.count] = codec.decode(s.data, s.count, block_size)
    return out


def segment_parts(segments: list[Segment]) -> list[Payload]:
    """`pack_segments`' blob as the buffers it is made of, in order, none copied: per
    segment three little-endian uint64 (offset, count, byte length), then its bytes. A
    store writes them one after the other (a stored delta is a tenth of a gigabyte at 1e9
    parameters: joining it first would copy it once more, on the merge's path)."""
    parts: list[Payload] = []
    for s in segments:
        parts.append(np.array([s.offset, s.count, len(s.data)], "<u8").tobytes())
        parts.append(s.data)
    return parts


def pack_segments(segments: list[Segment]) -> bytes:
    """Segments as one blob (`segment_parts` joined): a stored delta; a benchmark's
    pre-encoded update."""
    return b"".join(segment_parts(segments))


def unpack_segments(blob: Payload) -> list[Segment]:
    """`pack_segments`' segments, their bytes slices of `blob` (views where it is a view)."""
    out, at = [], 0
    while at < len(blob):
        offset, count, length = (int(x) for x in np.frombuffer(blob, "<u8", 3, at))
        at += 24
        out.append(Segment(offset, count, blob[at : at + length]))
        at += length
    return out
