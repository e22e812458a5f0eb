"""Blockwise payloads, and decoding them at the synchronizer's speed.

A blockwise payload holds each block's float32 scale, then every value's code packed into
bytes (1, 2, 4 or 8 codes a byte, the first in the lowest bits). A value decodes to its code's
level times its block's scale, in float32.

Decoding is the synchronizer's hot path: every chunk of every update it merges. It works a
chunk of whole blocks at a time, small enough to stay in cache between its steps: the codes
become their levels (int8 codes as they are; offset 4-bit codes unpacked with integer
operations, eight codes a machine word; other codes through a 256-row table of each byte's
levels), are multiplied by their blocks' scales, and are either written out (`decode`) or,
times a weight, added into an accumulator (`decode_into`), so a decoded segment is never
built whole. Both give, bit for bit, what decoding each value on its own gives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from services import kernels

DEFAULT_BLOCK_SIZE = 256
MAX_BLOCK_SIZE = 1 << 20
# Values decoded a chunk: their float32 values (512 KiB) stay in cache between the steps,
# and the Python loop over chunks costs nothing beside them.
DECODE_CHUNK = 1 << 17
FLOAT32_MAX = float(np.finfo(np.float32).max)
# An encoded payload: bytes, or a view of the message it arrived in (never copied to read).
Payload = bytes | memoryview


class CodecError(ValueError):
    """A payload or codec parameter is invalid; the message says what and what to do."""


class OverSquares(ValueError):
    """A chunk's sum of squares passed what the caller allowed it (`max_squares`): it was
    refused before any of it was added (taken out again, values far larger than the sum's
    would have cancelled the other updates' bits in it)."""

    def __init__(self, squares: float) -> None:
        super().__init__(f"the chunk's sum of squares {squares:.3g} is over its budget")
        self.squares = squares


def check_squares(squares: float, max_squares: float) -> None:
    if not squares <= max_squares:
        raise OverSquares(squares)


def blocks_of(n: int, block_size: int) -> int:
    return -(-n // block_size)


def check_block_size(block_size: int) -> None:
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise CodecError(
            f"block_size {block_size} is out of range; use 1..{MAX_BLOCK_SIZE} "
            f"(default {DEFAULT_BLOCK_SIZE})"
        )


def expect_len(payload: Payload, expected: int, what: str) -> None:
    if len(payload) != expected:
        raise CodecError(
            f"{what} payload is {len(payload)} bytes, expected {expected} for the values "
            "announced in its header; the header or the payload is corrupt"
        )


def finite(values: np.ndarray) -> np.ndarray:
    if not np.isfinite(values).all():
        raise CodecError("payload holds NaN or Inf values; the learner's update diverged")
    return values


def scales_and_body(
    payload: Payload, n: int, block_size: int, body_len: int, what: str
) -> tuple[np.ndarray, np.ndarray]:
    """A payload of per-block float32 scales then `body_len` bytes: the checked scales
    (finite, not negative), and the body as bytes."""
    check_block_size(block_size)
    nb = blocks_of(n, block_size)
    expect_len(payload, 4 * nb + body_len, what)
    scales = finite(np.frombuffer(payload, "<f4", count=nb))
    if (scales < 0).any():
        raise CodecError(f"{what} payload has a negative block scale; the payload is corrupt")
    return scales, np.frombuffer(payload, np.uint8, offset=4 * nb)


def target(acc: np.ndarray, offset: int, count: int, what: str) -> np.ndarray:
    """acc[offset : offset + count], or CodecError if the segment lies outside acc."""
    if not 0 <= offset <= offset + count <= acc.size:
        raise CodecError(
            f"{what} segment of {count} values at {offset} lies outside the fragment's "
            f"{acc.size} values; the header or the payload is corrupt"
        )
    return acc[offset : offset + count]


def check_limit(largest: float, weight: float, limit: float, what: str) -> None:
    """Refuse values whose largest magnitude times the weight could pass `limit`."""
    if not largest * abs(weight) <= limit:
        raise CodecError(
            f"{what} payload's values times the weight {weight:g} could reach "
            f"{largest * abs(weight):.3g}, past {limit:.3g}; the update diverged or the payload "
            "is corrupt"
        )


def byte_table(levels: np.ndarray, per_byte: int) -> np.ndarray:
    """(256, per_byte) float32: each byte's codes, lowest bits first, as their levels."""
    bits = 8 // per_byte
    codes = (np.arange(256)[:, None] >> (bits * np.arange(per_byte))) & ((1 << bits) - 1)
    return np.ascontiguousarray(levels[codes], np.float32)


@dataclass
class _Scratch:
    """One call's buffers, a chunk long."""

    size: int
    f32: np.ndarray = field(init=False)
    i8: np.ndarray = field(init=False)
    wide: np.ndarray = field(init=False)
    shifted: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.f32 = np.empty(self.size, np.float32)
        self.i8 = np.empty(self.size, np.int8)
        self.wide = np.empty(self.size // 2 + 1, "<u2")
        self.shifted = np.empty(self.size // 2 + 1, "<u2")


# The levels of values [start, stop) (start at a chunk's first value): an int8 array, or
# float32 levels written into `target` (room for whole bytes) and returned.
Levels = Callable[[np.ndarray, int, int, _Scratch, np.ndarray], np.ndarray]


def int8_levels(body: np.ndarray, start: int, stop: int, _: _Scratch, __: np.ndarray) -> np.ndarray:
    """int8 codes are their own levels."""
    return body.view(np.int8)[start:stop]


def offset_nibble_levels(
    body: np.ndarray, start: int, stop: int, scratch: _Scratch, _: np.ndarray
) -> np.ndarray:
    """4-bit codes c stored two a byte, level c - 8: each byte widened to 16 bits with its
    high nibble moved up to the second byte, which lays the codes out one a byte in order
    (little-endian), then 8 taken off each."""
    packed = body[start // 2 : -(-stop // 2)]
    wide, shifted = scratch.wide[: packed.size], scratch.shifted[: packed.size]
    np.copyto(wide, packed, casting="unsafe")
    np.left_shift(wide, 4, out=shifted)
    np.bitwise_or(wide, shifted, out=wide)
    np.bitwise_and(wide, 0x0F0F, out=wide)
    levels = scratch.i8[: 2 * packed.size]
    np.subtract(wide.view(np.int8), np.int8(8), out=levels)
    return levels[: stop - start]


def table_levels(table: np.ndarray) -> Levels:
    """Codes packed table.shape[1] a byte, each byte looked up in `table` (byte_table)."""
    per_byte = table.shape[1]

    def levels(
        body: np.ndarray, start: int, stop: int, _: _Scratch, target: np.ndarray
    ) -> np.ndarray:
        packed = body[start // per_byte : -(-stop // per_byte)]
        room = target[: packed.size * per_byte].reshape(-1, per_byte)
        # mode="clip" (bytes are always in range): with "raise", take buffers its output.
        np.take(table, packed, axis=0, out=room, mode="clip")
        return target[: stop - start]

    return levels


def scale_blocks(values: np.ndarray, scales: np.ndarray, block_size: int, out: np.ndarray) -> None:
    """out = values times their block's scale (float32); values start at a block's first
    value. Int8 values are cast exactly by the multiplication itself."""
    full = values.size // block_size
    head = full * block_size
    np.multiply(
        values[:head].reshape(full, block_size),
        scales[:full, None],
        out=out[:head].reshape(full, block_size),
    )
    if head < values.size:
        np.multiply(values[head:], scales[full], out=out[head:])


@dataclass(frozen=True)
class Fused:
    """A codec's compiled one-pass decoders (services.kernels), for blocks of whole bytes."""

    into: Callable[[np.ndarray, np.float32, np.ndarray, np.ndarray, int], float]
    decode: Callable[[np.ndarray, np.ndarray, np.ndarray, int], None]
    move: Callable[[np.ndarray, np.ndarray, np.float32, np.ndarray, np.ndarray, int], None]
    squares: Callable[[np.ndarray, np.ndarray, int, int], float]  # `into`'s, adding nothing
    # `into` of several chunks of one range at once (kernels.int8_into_many)
    into_many: Callable[..., None]
    codes: type[np.integer]  # what the packed body is read as
    # out = base + decoded, in one pass (kernels.int8_onto): a delta onto the value it follows
    onto: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int], None]


@dataclass(frozen=True)
class Ready:
    """A chunk's payload checked for `Blockwise.decode_many`, at the weight it is added."""

    weight: float
    scales: np.ndarray
    codes: np.ndarray  # the packed body, as the codec's compiled kernels read it


INT8_FUSED = Fused(
    kernels.int8_into,
    kernels.int8_decode,
    kernels.int8_move,
    kernels.int8_squares,
    kernels.int8_into_many,
    np.int8,
    kernels.int8_onto,
)
NIBBLE_FUSED = Fused(
    kernels.nibble_into,
    kernels.nibble_decode,
    kernels.nibble_move,
    kernels.nibble_squares,
    kernels.nibble_into_many,
    np.uint8,
    kernels.nibble_onto,
)


@dataclass(frozen=True)
class Blockwise:
    """The decoding side of a blockwise codec."""

    what: str  # the codec's name, for error messages
    per_byte: int  # codes a byte
    largest_level: float  # the largest |level| of any code
    levels: Levels
    fused: Fused | None = None  # compiled decoders, where the codec has them

    def _fused(self, block_size: int) -> Fused | None:
        return self.fused if block_size % self.per_byte == 0 else None

    def parts(self, payload: Payload, n: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The checked scales and the packed codes of a payload."""
        return scales_and_body(payload, n, block_size, -(-n // self.per_byte), self.what)

    def check(self, payload: Payload, n: int, block_size: int) -> None:
        self.parts(payload, n, block_size)

    def _levels(
        self, body: np.ndarray, start: int, stop: int, scratch: _Scratch, target: np.ndarray
    ) -> np.ndarray:
        """The float32 levels of values [start, stop), in `target`: integer levels are cast
        on their own first (exactly), which numpy does faster than inside the scaling."""
        levels = self.levels(body, start, stop, scratch, target)
        values = target[: stop - start]
        if levels.dtype != np.float32:
            np.copyto(values, levels, casting="unsafe")
        return values

    def _chunk(self, block_size: int) -> int:
        """Values a chunk: whole blocks and whole bytes."""
        unit = block_size * self.per_byte
        return max(1, DECODE_CHUNK // unit) * unit

    def _squares(self, scales: np.ndarray, body: np.ndarray, n: int, block_size: int) -> float:
        """The decoded values' sum of squares (as `decode_into` returns it), a chunk of
        whole blocks at a time."""
        fused = self._fused(block_size)
        if fused is not None:
            return float(fused.squares(body.view(fused.codes), scales, block_size, n))
        squares = 0.0
        for _, values in self._pieces(scales, body, n, block_size):
            squares += kernels.float32_squares(values)
        return squares

    def _pieces(
        self, scales: np.ndarray, body: np.ndarray, n: int, block_size: int
    ) -> Iterator[tuple[int, np.ndarray]]:
        """The decoded values, a chunk of whole blocks at a time, each with where it
        starts: in one scratch buffer, so each piece is gone once the next is made."""
        step = self._chunk(block_size)
        scratch = _Scratch(min(step, n + self.per_byte))
        for start in range(0, n, step):
            stop = min(start + step, n)
            values = self._levels(body, start, stop, scratch, scratch.f32)
            scale_blocks(values, scales[start // block_size :], block_size, values)
            yield start, values

    def starts_block(self, start: int, block_size: int) -> bool:
        """Whether value `start` begins a block and a byte of codes: where `decode_range`
        may begin."""
        return start % block_size == 0 and start % self.per_byte == 0

    def decode_range(
        self, payload: Payload, n: int, block_size: int, start: int, stop: int
    ) -> np.ndarray:
        """Values [start, stop) of a payload of n values, decoded as `decode` decodes them,
        without decoding the rest; `start` a multiple of block_size and of the codes a
        byte (ValueError otherwise)."""
        if not self.starts_block(start, block_size) or not 0 <= start < stop <= n:
            raise ValueError(
                f"values [{start}, {stop}) of {n} do not start on a {self.what} block "
                f"of {block_size}"
            )
        scales, body = self.parts(payload, n, block_size)
        scratch = _Scratch(stop - start + self.per_byte)
        values = self._levels(body, start, stop, scratch, scratch.f32)
        scale_blocks(values, scales[start // block_size :], block_size, values)
        return values

    def decode(self, payload: Payload, n: int, block_size: int) -> np.ndarray:
        scales, body = self.parts(payload, n, block_size)
        fused = self._fused(block_size)
        if fused is not None:
            decoded = np.empty(n, np.float32)
            fused.decode(decoded, body.view(fused.codes), scales, block_size)
            return decoded
        step = self._chunk(block_size)
        scratch = _Scratch(min(step, n + self.per_byte))
        out = np.empty(body.size * self.per_byte, np.float32)  # table lookups write whole bytes
        for start in range(0, n, step):
            stop = min(start + step, n)
            values = self._levels(body, start, stop, scratch, out[start:])
            scale_blocks(values, scales[start // block_size :], block_size, values)
        return out[:n]

    def decode_onto(
        self,
        base: np.ndarray,
        out: np.ndarray,
        offset: int,
        count: int,
        payload: Payload,
        block_size: int,
    ) -> bool:
        """out[offset : offset + count] = the same of base + the decoded values, in float32
        (bit for bit decode, then np.add), in one compiled pass; False, nothing written, where
        the codec has none for `block_size`. CodecError for a bad payload or a segment
        outside either array."""
        fused = self._fused(block_size)
        if fused is None:
            return False
        scales, body = self.parts(payload, count, block_size)
        o, x = target(out, offset, count, self.what), target(base, offset, count, self.what)
        fused.onto(o, x, body.view(fused.codes), scales, block_size)
        return True

    def move_into(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        weight: float,
        offset: int,
        count: int,
        payload: Payload,
        block_size: int,
    ) -> bool:
        """A payload `decode_into` added into `src` at `weight` moves to `dst`, in one
        compiled pass, bit for bit what adding it at -weight into src and at weight into dst
        gives. False (nothing done) where the codec has no compiled path for `block_size`."""
        fused = self._fused(block_size)
        if fused is None:
            return False
        scales, body = self.parts(payload, count, block_size)
        a, b = target(src, offset, count, self.what), target(dst, offset, count, self.what)
        fused.move(a, b, np.float32(weight), body.view(fused.codes), scales, block_size)
        return True

    def ready(
        self,
        acc: np.ndarray,
        weight: float,
        offset: int,
        count: int,
        payload: Payload,
        block_size: int,
        limit: float = FLOAT32_MAX,
        max_squares: float = math.inf,
    ) -> Ready | None:
        """A payload checked as `decode_into` checks it before adding anything, to be summed
        with other chunks of its range (`decode_many`); CodecError as `decode_into` raises
        it. None where it must go alone through `decode_into`: the codec has no compiled
        path for `block_size`, or its scales allow more than `max_squares` (its squares are
        then summed before anything is added)."""
        fused = self._fused(block_size)
        if fused is None:
            return None
        scales, body = self.parts(payload, count, block_size)
        target(acc, offset, count, self.what)
        if self._past_budget(scales, weight, block_size, limit, max_squares):
            return None
        return Ready(weight, scales, body.view(fused.codes))

    def _past_budget(
        self, scales: np.ndarray, weight: float, block_size: int, limit: float, max_squares: float
    ) -> bool:
        """CodecError for values that times `weight` could pass `limit`; whether the most
        sum of squares the scales allow passes `max_squares`."""
        largest = float(scales.max()) * self.largest_level if scales.size else 0.0
        check_limit(largest, weight, limit, self.what)
        if not math.isfinite(max_squares):
            return False
        scales64 = scales.astype(np.float64)
        most = float(np.dot(scales64, scales64)) * block_size * self.largest_level**2
        return most > max_squares

    def decode_many(
        self, acc: np.ndarray, offset: int, count: int, block_size: int, chunks: list[Ready]
    ) -> list[float]:
        """`decode_into` of each chunk of one range in turn (each `ready` for it), bit for
        bit, in compiled passes that read and write each block of the sum once for up to
        kernels.MANY chunks. Their sums of squares, in order."""
        fused = self._fused(block_size)
        assert fused is not None, "decode_many of chunks no compiled path sums"
        whole = target(acc, offset, count, self.what)
        squares: list[float] = []
        for start in range(0, len(chunks), kernels.MANY):
            some = chunks[start : start + kernels.MANY]
            ws = np.array([c.weight for c in some], np.float32)
            scales = np.stack([c.scales for c in some])
            out = np.zeros(kernels.MANY)
            codes = kernels.readonly_many([c.codes for c in some])
            fused.into_many(whole, ws, codes, scales, block_size, len(some), out)
            squares.extend(float(x) for x in out[: len(some)])
        return squares

    def decode_into(
        self,
        acc: np.ndarray,
        weight: float,
        offset: int,
        count: int,
        payload: Payload,
        block_size: int,
        limit: float = FLOAT32_MAX,
        max_squares: float = math.inf,
    ) -> float:
        """acc[offset : offset + count] += float32(weight) * decoded, bit for bit what
        decoding the payload, multiplying by the weight and adding do in float32. Returns
        the decoded values' sum of squares. Raises CodecError, with `acc` untouched, for a
        payload `check` refuses or one whose values times the weight could pass `limit`;
        OverSquares, `acc` untouched, for one whose sum of squares passes `max_squares`."""
        scales, body = self.parts(payload, count, block_size)
        whole = target(acc, offset, count, self.what)
        if self._past_budget(scales, weight, block_size, limit, max_squares):
            # The squares themselves, summed first (a pass over the codes, nothing added,
            # nothing built whole).
            check_squares(self._squares(scales, body, count, block_size), max_squares)
        w = np.float32(weight)
        fused = self._fused(block_size)
        if fused is not None:
            return float(fused.into(whole, w, body.view(fused.codes), scales, block_size))
        squares = 0.0
        for start, values in self._pieces(scales, body, count, block_size):
            squares += kernels.float32_squares(values)
            if w != 1:  # times one is exact: skipped
                np.multiply(values, w, out=values)
            part = whole[start : start + values.size]
            np.add(part, values, out=part)
        return squares
