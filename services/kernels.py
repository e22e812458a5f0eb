"""Compiled loops for the synchronizer's hot path: decoding int8 and 4-bit blockwise codes
and adding them, weighed, into a float32 accumulator (or moving them from one to another),
in one pass per value; and the outer step with its downlink delta.

numpy needs a pass over a chunk per operation (widen, cast, scale, square, weigh, add), which
caps decoding int4 at about 0.6 GB/s of payload a core; one compiled pass reaches the memory's
speed. Each value is computed exactly as numpy computes it (float32 level times float32 scale,
times float32 weight, added in float32: no fused multiply-add, no reordering), so the results
are bit for bit the numpy path's. Sums of squares are exact per block (integer levels squared
and summed as integers, times the block's scale squared in float64); fp32's alone is summed in
any order (`float32_squares`: it only bounds an update's norm).

A loop the compiler cannot vectorize (a branch, or a value carried from one iteration to
the next) runs several times slower than memory: the outer step is written as one loop per
job over each block.

Every kernel releases the GIL, so the owner's worker threads run them on several cores.
Compiled code is cached on disk (numba's cache), so only a machine's first process pays for
compiling; `warm()` compiles them ahead of the first update.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Block loops slice their arrays once per block: the inner loop then runs over contiguous
# views the compiler vectorizes.
_kernel = njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")

# Squares of int8 levels are summed in int32 over spans of at most SPAN values (at most
# 2**30 a span), then widened: numba's integer arithmetic is 64-bit unless narrowed, and
# 64-bit lanes halve what each vector instruction of the summing loop holds.
SPAN = 1 << 16


@_kernel
def int8_into(
    acc: np.ndarray, w: np.float32, codes: np.ndarray, scales: np.ndarray, bs: int
) -> float:
    """acc += (float32(code) * scale) * w per value; codes int8; returns the sum of squares of
    the decoded values."""
    n = acc.size
    squares = 0.0
    for b in range(scales.size):
        lo = b * bs
        hi = min(lo + bs, n)
        s = scales[b]
        total = np.int64(0)
        for start in range(lo, hi, SPAN):
            end = min(start + SPAN, hi)
            a = acc[start:end]
            c = codes[start:end]
            part = np.int32(0)
            for i in range(end - start):
                level = np.int32(c[i])
                part = np.int32(part + np.int32(level * level))
                a[i] += (np.float32(level) * s) * w
            total += np.int64(part)
        squares += np.float64(s) * np.float64(s) * np.float64(total)
    return squares


# Chunks one call of an `*_into_many` kernel sums at most: its codes come in a tuple of
# this many arrays (the ones past `used` repeat the first), so each kernel compiles once.
MANY = 8


def readonly_many(arrays: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """The arrays of an `*_into_many` call as one type (read-only views), MANY of them."""
    views = []
    for array in arrays:
        view = array.view()
        view.flags.writeable = False
        views.append(view)
    return tuple(views + [views[0]] * (MANY - len(views)))


@_kernel
def int8_into_many(
    acc: np.ndarray,
    ws: np.ndarray,
    codes: tuple[np.ndarray, ...],
    scales: np.ndarray,
    bs: int,
    used: int,
    squares: np.ndarray,
) -> None:
    """int8_into of chunks 0..used-1 of one range in turn, block by block: each block of
    `acc` is read and written once for all of them, not once each. Per value the same
    float32 operations in the same order as int8_into chunk after chunk, so bit for bit
    its sum; squares[k] += chunk k's sum of squares, summed as int8_into sums it."""
    n = acc.size
    totals = np.zeros(used, np.int64)
    for b in range(scales.shape[1]):
        lo = b * bs
        hi = min(lo + bs, n)
        totals[:] = 0
        for start in range(lo, hi, SPAN):
            end = min(start + SPAN, hi)
            a = acc[start:end]
            for k in range(used):
                s = scales[k, b]
                w = ws[k]
                c = codes[k][start:end]
                part = np.int32(0)
                for i in range(end - start):
                    level = np.int32(c[i])
                    part = np.int32(part + np.int32(level * level))
                    a[i] += (np.float32(level) * s) * w
                totals[k] += part
        for k in range(used):
            s = scales[k, b]
            squares[k] += np.float64(s) * np.float64(s) * np.float64(totals[k])


@_kernel
def int8_decode(out: np.ndarray, codes: np.ndarray, scales: np.ndarray, bs: int) -> None:
    n = out.size
    for b in range(scales.size):
        lo = b * bs
        hi = min(lo + bs, n)
        s = scales[b]
        o = out[lo:hi]
        c = codes[lo:hi]
        for i in range(hi - lo):
            o[i] = np.float32(c[i]) * s


@_kernel
def int8_onto(
    out: np.ndarray, base: np.ndarray, codes: np.ndarray, scales: np.ndarray, bs: int
) -> None:
    """out = base + float32(code) * scale per value, in float32: a delta decoded onto the
    value it follows in one pass (bit for bit int8_decode, then adding)."""
    n = out.size
    for b in range(scales.size):
        lo = b * bs
        hi = min(lo + bs, n)
        s = scales[b]
        o = out[lo:hi]
        x = base[lo:hi]
        c = codes[lo:hi]
        for i in range(hi - lo):
            o[i] = x[i] + np.float32(c[i]) * s


@_kernel
def nibble_into(
    acc: np.ndarray, w: np.float32, body: np.ndarray, scales: np.ndarray, bs: int
) -> float:
    """4-bit codes c two a byte (lowest bits first), level c - 8: acc += (float32(level) *
    scale) * w per value. bs must be even (a block is whole bytes)."""
    n = acc.size
    pairs = n // 2
    half = bs // 2
    squares = 0.0
    for b in range(scales.size):
        lo = b * half
        hi = min(lo + half, pairs)
        if hi <= lo:
            break
        s = scales[b]
        a = acc[2 * lo : 2 * hi]
        c = body[lo:hi]
        total = np.int32(0)
        for j in range(hi - lo):
            byte = np.int32(c[j])
            first = np.int32((byte & 15) - 8)
            second = np.int32((byte >> 4) - 8)
            total = np.int32(total + np.int32(first * first + second * second))
            a[2 * j] += (np.float32(first) * s) * w
            a[2 * j + 1] += (np.float32(second) * s) * w
        squares += np.float64(s) * np.float64(s) * np.float64(total)
    if n % 2:
        level = (np.int32(body[pairs]) & 15) - 8
        s = scales[(n - 1) // bs]
        acc[n - 1] += (np.float32(level) * s) * w
        squares += np.float64(s) * np.float64(s) * np.float64(level * level)
    return squares


@_kernel
def nibble_into_many(
    acc: np.ndarray,
    ws: np.ndarray,
    bodies: tuple[np.ndarray, ...],
    scales: np.ndarray,
    bs: int,
    used: int,
    squares: np.ndarray,
) -> None:
    """int8_into_many for 4-bit codes two a byte: nibble_into of each chunk in turn, bit for
    bit, each block of `acc` read and written once for all of them."""
    n = acc.size
    pairs = n // 2
    half = bs // 2
    for b in range(scales.shape[1]):
        lo = b * half
        hi = min(lo + half, pairs)
        if hi <= lo:
            break
        a = acc[2 * lo : 2 * hi]
        for k in range(used):
            s = scales[k, b]
            w = ws[k]
            c = bodies[k][lo:hi]
            total = np.int32(0)
            for j in range(hi - lo):
                byte = np.int32(c[j])
                first = np.int32((byte & 15) - 8)
                second = np.int32((byte >> 4) - 8)
                total = np.int32(total + np.int32(first * first + second * second))
                a[2 * j] += (np.float32(first) * s) * w
                a[2 * j + 1] += (np.float32(second) * s) * w
            squares[k] += np.float64(s) * np.float64(s) * np.float64(total)
    if n % 2:
        for k in range(used):
            level = (np.int32(bodies[k][pairs]) & 15) - 8
            s = scales[k, (n - 1) // bs]
            acc[n - 1] += (np.float32(level) * s) * ws[k]
            squares[k] += np.float64(s) * np.float64(s) * np.float64(level * level)


@_kernel
def int8_move(
    src: np.ndarray, dst: np.ndarray, w: np.float32, codes: np.ndarray, scales: np.ndarray, bs: int
) -> None:
    """A chunk summed into `src` at weight w moves to `dst`: v = (float32(code) * scale) * w,
    src -= v, dst += v per value. Bit for bit int8_into at -w into src, then at w into dst
    (negating is exact), decoding once."""
    n = src.size
    for b in range(scales.size):
        lo = b * bs
        hi = min(lo + bs, n)
        s = scales[b]
        a = src[lo:hi]
        d = dst[lo:hi]
        c = codes[lo:hi]
        for i in range(hi - lo):
            v = (np.float32(c[i]) * s) * w
            a[i] -= v
            d[i] += v


@_kernel
def nibble_move(
    src: np.ndarray, dst: np.ndarray, w: np.float32, body: np.ndarray, scales: np.ndarray, bs: int
) -> None:
    """int8_move for 4-bit codes two a byte (nibble_into's)."""
    n = src.size
    pairs = n // 2
    half = bs // 2
    for b in range(scales.size):
        lo = b * half
        hi = min(lo + half, pairs)
        if hi <= lo:
            break
        s = scales[b]
        a = src[2 * lo : 2 * hi]
        d = dst[2 * lo : 2 * hi]
        c = body[lo:hi]
        for j in range(hi - lo):
            byte = np.int32(c[j])
            first = (np.float32(np.int32((byte & 15) - 8)) * s) * w
            second = (np.float32(np.int32((byte >> 4) - 8)) * s) * w
            a[2 * j] -= first
            d[2 * j] += first
            a[2 * j + 1] -= second
            d[2 * j + 1] += second
    if n % 2:
        v = (np.float32((np.int32(body[pairs]) & 15) - 8) * scales[(n - 1) // bs]) * w
        src[n - 1] -= v
        dst[n - 1] += v


@_kernel
def nibble_decode(out: np.ndarray, body: np.ndarray, scales: np.ndarray, bs: int) -> None:
    n = out.size
    pairs = n // 2
    half = bs // 2
    for b in range(scales.size):
        lo = b * half
        hi = min(lo + half, pairs)
        if hi <= lo:
            break
        s = scales[b]
        o = out[2 * lo : 2 * hi]
        c = body[lo:hi]
        for j in range(hi - lo):
            byte = np.int32(c[j])
            o[2 * j] = np.float32(np.int32((byte & 15) - 8)) * s
            o[2 * j + 1] = np.float32(np.int32((byte >> 4) - 8)) * s
    if n % 2:
        out[n - 1] = np.float32((np.int32(body[pairs]) & 15) - 8) * scales[(n - 1) // bs]


@_kernel
def nibble_onto(
    out: np.ndarray, base: np.ndarray, body: np.ndarray, scales: np.ndarray, bs: int
) -> None:
    """int8_onto for 4-bit codes two a byte (nibble_decode's, then adding)."""
    n = out.size
    pairs = n // 2
    half = bs // 2
    for b in range(scales.size):
        lo = b * half
        hi = min(lo + half, pairs)
        if hi <= lo:
            break
        s = scales[b]
        o = out[2 * lo : 2 * hi]
        x = base[2 * lo : 2 * hi]
        c = body[lo:hi]
        for j in range(hi - lo):
            byte = np.int32(c[j])
            o[2 * j] = x[2 * j] + np.float32(np.int32((byte & 15) - 8)) * s
            o[2 * j + 1] = x[2 * j + 1] + np.float32(np.int32((byte >> 4) - 8)) * s
    if n % 2:
        level = np.float32(np.int32((np.int32(body[pairs]) & 15) - 8))
        out[n - 1] = base[n - 1] + level * scales[(n - 1) // bs]


@_kernel
def add_weighed(acc: np.ndarray, values: np.ndarray, w: np.float32) -> None:
    """acc += values * w in float32 (times one skipped: it is exact)."""
    if w == 1:
        for i in range(acc.size):
            acc[i] += values[i]
    else:
        for i in range(acc.size):
            acc[i] += values[i] * w


@_kernel
def int8_squares(codes: np.ndarray, scales: np.ndarray, bs: int, n: int) -> float:
    """int8_into's sum of squares of n values, without adding them anywhere."""
    squares = 0.0
    for b in range(scales.size):
        lo = b * bs
        hi = min(lo + bs, n)
        total = np.int64(0)
        for start in range(lo, hi, SPAN):
            end = min(start + SPAN, hi)
            c = codes[start:end]
            part = np.int32(0)
            for i in range(end - start):
                level = np.int32(c[i])
                part = np.int32(part + np.int32(level * level))
            total += np.int64(part)
        s = scales[b]
        squares += np.float64(s) * np.float64(s) * np.float64(total)
    return squares


@_kernel
def nibble_squares(body: np.ndarray, scales: np.ndarray, bs: int, n: int) -> float:
    """nibble_into's sum of squares of n values, without adding them anywhere."""
    pairs = n // 2
    half = bs // 2
    squares = 0.0
    for b in range(scales.size):
        lo = b * half
        hi = min(lo + half, pairs)
        if hi <= lo:
            break
        c = body[lo:hi]
        total = np.int32(0)
        for j in range(hi - lo):
            byte = np.int32(c[j])
            first = np.int32((byte & 15) - 8)
            second = np.int32((byte >> 4) - 8)
            total = np.int32(total + np.int32(first * first + second * second))
        s = scales[b]
        squares += np.float64(s) * np.float64(s) * np.float64(total)
    if n % 2:
        level = (np.int32(body[pairs]) & 15) - 8
        s = scales[(n - 1) // bs]
        squares += np.float64(s) * np.float64(s) * np.float64(level * level)
    return squares


@njit(nogil=True, cache=True, boundscheck=False, fastmath={"reassoc"})
def float32_squares(values: np.ndarray) -> float:
    """The sum of squares of float32 values, in float64. Any order of the sum will do (it
    bounds an update's norm), so the loop may be reordered to vectorize: at memory speed
    wherever the values lie, where numpy's dot copies an unaligned array first."""
    total = 0.0
    for i in range(values.size):
        v = np.float64(values[i])
        total += v * v
    return total


@_kernel
def float32_move(src: np.ndarray, dst: np.ndarray, w: np.float32, values: np.ndarray) -> None:
    """Values add_weighed added into `src` at weight w move to `dst`: v = values * w (times
    one skipped: exact), src -= v, dst += v; bit for bit add_weighed at -w into src, then
    at w into dst."""
    if w == 1:
        for i in range(src.size):
            src[i] -= values[i]
            dst[i] += values[i]
    else:
        for i in range(src.size):
            v = values[i] * w
            src[i] -= v
            dst[i] += v


def warm_decoders() -> None:
    """Compile (or load from the cache) what a learner applies new values with: decoding,
    and decoding onto the value a delta follows."""
    acc = np.zeros(4, np.float32)
    scales = np.frombuffer(np.ones(2, np.float32).tobytes(), np.float32)
    payload = np.frombuffer(bytes(4), np.uint8)
    int8_decode(acc, payload.view(np.int8), scales, 2)
    nibble_decode(acc, payload, scales, 2)
    int8_onto(acc, acc.copy(), payload.view(np.int8), scales, 2)
    nibble_onto(acc, acc.copy(), payload, scales, 2)


def warm() -> None:
    """Compile (or load from the cache) every kernel for the types the codecs pass."""
    warm_decoders()
    acc = np.zeros(4, np.float32)
    scales = np.frombuffer(np.ones(2, np.float32).tobytes(), np.float32)
    payload = np.frombuffer(bytes(4), np.uint8)
    int8_into(acc, np.float32(1), payload.view(np.int8), scales, 2)
    nibble_into(acc, np.float32(1), payload, scales, 2)
    int8_move(acc, acc.copy(), np.float32(1), payload.view(np.int8), scales, 2)
    nibble_move(acc, acc.copy(), np.float32(1), payload, scales, 2)
    values = np.frombuffer(acc.tobytes(), np.float32)
    add_weighed(acc, values, np.float32(1))
    float32_move(acc, acc.copy(), np.float32(1), values)
    # A chunk's payload read in place lies anywhere in its message: unaligned too.
    unaligned = np.frombuffer(bytes(17), np.uint8)[1:].view(np.float32)
    add_weighed(acc, unaligned, np.float32(1))
    float32_move(acc, acc.copy(), np.float32(1), unaligned)
    float32_squares(values)
    float32_squares(unaligned)
    int8_squares(payload.view(np.int8), scales, 2, 4)
    ws, squares, table = np.ones(MANY, np.float32), np.zeros(MANY), np.ones((1, 2), np.float32)
    int8_into_many(acc, ws, readonly_many([payload.view(np.int8)]), table, 2, 1, squares)
    nibble_into_many(acc, ws, readonly_many([payload]), table, 2, 1, squares)
    nibble_squares(payload, scales, 2, 4)
    one, none = np.float32(1), np.zeros(0, np.float32)
    out = np.zeros(12, np.uint8)
    for per_byte in (1, 2):
        uniform_step(
            acc, one, none, one, one, acc.copy(), acc.copy(), out[:8].view(np.float32),
            out[8:], 2, 7, per_byte, one, one, one,
        )  # fmt: skip
    fp32_step(acc, one, none, one, one, acc.copy(), acc.copy(), acc.copy())


@njit(inline="always")
def _want(
    total: np.float32,
    factor: np.float32,
    trace: np.ndarray,
    i: int,
    momentum: np.float32,
    neg_lr: np.float32,
    residual: np.float32,
) -> np.float32:
    """One value's move plus its residual, as OuterOptimizer.move then the residual's add:
    g = total * factor; with momentum (a trace to update) trace[i] = trace[i] * momentum +
    g and g += momentum * trace[i]; then g * -lr + residual."""
    g = total * factor
    if trace.size:
        kept = trace[i] * momentum + g
        trace[i] = kept
        g = g + momentum * kept
    return g * neg_lr + residual


@_kernel
def uniform_step(
    total: np.ndarray,
    factor: np.float32,
    trace: np.ndarray,
    momentum: np.float32,
    neg_lr: np.float32,
    residual: np.ndarray,
    theta: np.ndarray,
    scales: np.ndarray,
    body: np.ndarray,
    bs: int,
    largest: int,
    per_byte: int,
    inverse: np.float32,
    tiny: np.float32,
    small: np.float32,
) -> None:
    """The synchronizer's outer step and downlink delta over one segment, one block at a
    time, as services.downlink.step_segment does it after OuterOptimizer.move: g = total *
    factor; with momentum, trace = trace * momentum + g and g += momentum * trace; want =
    g * -lr + residual; want encoded (codec.uniform_payload's definition: per_byte 1 for
    int8 codes, 2 for 4-bit codes + 8, two a byte), theta += decoded, residual = want -
    decoded. bs must be even where per_byte is 2."""
    n = total.size
    want = np.empty(bs, np.float32)
    levels = np.empty(bs, np.int32)
    # A block's largest |want| from the bits: the magnitudes of floats order as their bits
    # do (a NaN's above every number, as numpy's max propagates it), and an integer max
    # vectorizes where a float one does not.
    bits = want.view(np.int32)
    top_bits = np.zeros(1, np.int32)
    top = top_bits.view(np.float32)
    limit = np.float32(largest)
    has_trace = trace.size > 0
    # Each block in loops of one job each, without a branch or a value carried from one
    # iteration to the next, so that each vectorizes: the moves, their largest magnitude,
    # the codes (theta and the residual on the way), the codes packed.
    for b in range(scales.size):
        lo = b * bs
        hi = min(lo + bs, n)
        m = hi - lo
        t = total[lo:hi]
        r = residual[lo:hi]
        th = theta[lo:hi]
        if has_trace:
            tr = trace[lo:hi]
            for j in range(m):
                g = t[j] * factor
                kept = tr[j] * momentum + g
                tr[j] = kept
                g = g + momentum * kept
                want[j] = g * neg_lr + r[j]
        else:
            for j in range(m):
                want[j] = t[j] * factor * neg_lr + r[j]
        largest_bits = np.int32(0)
        for j in range(m):
            magnitude = bits[j] & np.int32(0x7FFFFFFF)
            largest_bits = magnitude if magnitude > largest_bits else largest_bits
        top_bits[0] = largest_bits
        scale = top[0] * inverse
        if scale < tiny:
            scale = np.float32(0.0)
        recip = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
        flush = scale > 0 and scale < small
        scales[b] = scale
        for j in range(m):
            w = want[j]
            v = np.float32(0.0) if flush and abs(w) < tiny else w
            code = np.rint(v * recip)
            code = code if code < limit else limit
            code = code if code > -limit else -limit
            level = np.int32(code)
            decoded = np.float32(level) * scale
            th[j] = th[j] + decoded
            r[j] = w - decoded
            levels[j] = level
        if per_byte == 1:
            out = body[lo:hi]
            for j in range(m):
                out[j] = np.uint8(levels[j] & 0xFF)
        else:  # blocks are of whole bytes: only the last may end in half of one
            half = m // 2
            out = body[lo // 2 : lo // 2 + half]
            for j in range(half):
                out[j] = np.uint8(levels[2 * j] + 8) | np.uint8((levels[2 * j + 1] + 8) << 4)
            if m % 2:
                body[(hi - 1) // 2] = np.uint8(levels[m - 1] + 8)


@_kernel
def fp32_step(
    total: np.ndarray,
    factor: np.float32,
    trace: np.ndarray,
    momentum: np.float32,
    neg_lr: np.float32,
    residual: np.ndarray,
    theta: np.ndarray,
    out: np.ndarray,
) -> None:
    """uniform_step for the fp32 downlink: the delta is want itself, theta += want, and the
    residual is want - want (zero)."""
    for i in range(total.size):
        w = _want(total[i], factor, trace, i, momentum, neg_lr, residual[i])
        out[i] = w
        theta[i] = theta[i] + w
        residual[i] = w - w
