import numpy as np
import pytest

from services import codec as codecs
from services import formats, kernels


@pytest.fixture
def values() -> np.ndarray:
    rng = np.random.default_rng(7)
    x = rng.normal(size=10_007).astype(np.float32)  # not a multiple of the block size
    x[:300] *= 50.0  # blocks with very different scales
    return x


def test_fp32_round_trip_is_exact(values: np.ndarray) -> None:
    c = codecs.by_name("fp32")
    np.testing.assert_array_equal(c.decode(c.encode(values, 0), values.size, 0), values)


def test_bf16_round_trip_within_half_an_ulp(values: np.ndarray) -> None:
    c = codecs.by_name("bf16")
    out = c.decode(c.encode(values, 0), values.size, 0)
    assert np.all(np.abs(out - values) <= np.abs(values) * 2.0**-8)


@pytest.mark.parametrize("block", [1, 64, 256, 4096])
def test_int8_error_within_half_a_quantum_per_block(values: np.ndarray, block: int) -> None:
    c = codecs.by_name("int8")
    payload = c.encode(values, block)
    out = c.decode(payload, values.size, block)
    nb = -(-values.size // block)
    assert len(payload) == 4 * nb + values.size
    padded = np.zeros(nb * block, np.float32)
    padded[: values.size] = np.abs(values)
    quantum = (padded.reshape(nb, block).max(axis=1) / 127.0).repeat(block)[: values.size]
    assert np.all(np.abs(out - values) <= quantum / 2 + 1e-6 * quantum)


def test_int8_of_zeros_decodes_to_zeros() -> None:
    c = codecs.by_name("int8")
    z = np.zeros(1000, np.float32)
    np.testing.assert_array_equal(c.decode(c.encode(z, 256), 1000, 256), z)


def test_a_flipped_byte_changes_the_checksum(values: np.ndarray) -> None:
    payload = bytearray(codecs.by_name("int8").encode(values, 256))
    before = codecs.checksum(bytes(payload))
    payload[len(payload) // 2] ^= 0x01
    assert codecs.checksum(bytes(payload)) != before


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_non_finite_values_are_refused(name: str) -> None:
    c = codecs.by_name(name)
    bad = np.ones(10, np.float32)
    bad[3] = np.nan
    with pytest.raises(codecs.CodecError, match="NaN or Inf"):
        c.decode(c.encode(bad, 0), 10, 0)
    with pytest.raises(codecs.CodecError, match="NaN or Inf"):
        c.check(c.encode(bad, 0), 10, 0)


def test_int8_with_a_nan_scale_is_refused() -> None:
    c = codecs.by_name("int8")
    payload = bytearray(c.encode(np.ones(512, np.float32), 256))
    payload[0:4] = np.array([np.inf], "<f4").tobytes()
    with pytest.raises(codecs.CodecError, match="NaN or Inf"):
        c.check(bytes(payload), 512, 256)


def test_wrong_length_and_bad_block_size_are_refused(values: np.ndarray) -> None:
    c = codecs.by_name("int8")
    payload = c.encode(values, 256)
    with pytest.raises(codecs.CodecError, match="expected"):
        c.decode(payload[:-1], values.size, 256)
    with pytest.raises(codecs.CodecError, match="block_size 0"):
        c.decode(payload, values.size, 0)


def test_unknown_codecs_name_the_supported_ones() -> None:
    with pytest.raises(codecs.CodecError, match="fp32"):
        codecs.by_name("int3")
    with pytest.raises(codecs.CodecError, match="not supported"):
        codecs.by_wire(99)


def test_error_feedback_keeps_the_sum_within_one_quantum() -> None:
    rng = np.random.default_rng(3)
    ef = codecs.ErrorFeedback(codecs.by_name("int8"), 64)
    sent = np.zeros(640, np.float64)
    true = np.zeros(640, np.float64)
    for _ in range(50):
        delta = rng.normal(scale=0.01, size=640).astype(np.float32)
        true += delta
        segments = ef.encode(delta)
        sent += codecs.decode_segments(codecs.by_name("int8"), segments, 640, 64)
    assert ef.residual is not None
    # What is still owed is exactly the residual, and it is below one quantum of the last block.
    np.testing.assert_allclose(true - sent, ef.residual, atol=1e-5)
    last_scale = np.abs(ef.residual).max()
    assert last_scale <= 0.05 / 127 * 2


@pytest.mark.parametrize("n", [1, 7, 256, 1001])
@pytest.mark.parametrize("block", [1, 64, 256])
def test_uniform_int4_error_within_half_a_quantum_per_block(n: int, block: int) -> None:
    x = np.random.default_rng(n).standard_t(3, size=n).astype(np.float32)
    codec = codecs.by_name("int4-uniform")
    payload = codec.encode(x, block)
    assert len(payload) == 4 * -(-n // block) + (n + 1) // 2
    codec.check(payload, n, block)
    y = codec.decode(payload, n, block)
    for start in range(0, n, block):
        xb, yb = x[start : start + block], y[start : start + block]
        quantum = np.abs(xb).max() / 7.0
        assert np.abs(yb - xb).max() <= quantum / 2 + 1e-6


@pytest.mark.parametrize("n", [1, 7, 256, 1001])
def test_e3m0_rounds_each_magnitude_to_a_power_of_two_of_its_block_max(n: int) -> None:
    x = np.random.default_rng(n).standard_t(3, size=n).astype(np.float32)
    codec = codecs.by_name("e3m0")
    payload = codec.encode(x, 64)
    codec.check(payload, n, 64)
    y = codec.decode(payload, n, 64)
    assert np.all(np.sign(y) * np.sign(x) >= 0)  # never the wrong sign
    for start in range(0, n, 64):
        xb, yb = x[start : start + 64], y[start : start + 64]
        absmax = np.abs(xb).max()
        big = np.abs(xb) >= absmax * 2.0**-6
        ratio = np.abs(yb[big]) / np.abs(xb[big])
        assert np.all(ratio <= 2**0.5 + 1e-6)
        assert np.all(ratio >= 2**-0.5 - 1e-6)
        small = np.abs(xb) < absmax * 2.0**-7
        assert np.all(yb[small] == 0.0)
        steps = np.log2(np.abs(yb[yb != 0]) / absmax)
        assert np.allclose(steps, np.rint(steps))  # every value is absmax * 2^e


@pytest.mark.parametrize("name", ["int4-uniform", "e3m0"])
def test_corrupt_four_bit_payloads_are_refused(name: str) -> None:
    codec = codecs.by_name(name)
    x = np.linspace(-1, 1, 300, dtype=np.float32)
    payload = codec.encode(x, 256)
    with pytest.raises(codecs.CodecError, match="bytes, expected"):
        codec.check(payload[:-1], 300, 256)
    negative = np.frombuffer(payload, np.uint8).copy()
    negative[3] |= 0x80  # the first block scale's sign bit
    with pytest.raises(codecs.CodecError, match="negative block scale"):
        codec.check(negative.tobytes(), 300, 256)


def test_int4_is_the_measured_default_and_has_a_wire_number() -> None:
    assert codecs.by_name("int4") is codecs.by_name(codecs.INT4_DEFAULT)
    assert codecs.by_wire(codecs.by_name("e3m0").wire).name == "e3m0"


@pytest.mark.parametrize("n", [1, 7, 256, 1001, 10_007])
@pytest.mark.parametrize("block", [16, 64, 256, 1024])
def test_topk_sends_each_blocks_largest_values_within_half_a_quantum(n: int, block: int) -> None:
    x = np.random.default_rng(n).standard_t(3, size=n).astype(np.float32)
    codec = codecs.by_name("topk")
    payload = codec.encode(x, block)
    codec.check(payload, n, block)
    y = codec.decode(payload, n, block)
    kept = max(1, block // formats.TOPK_SHARE)
    for start in range(0, n, block):
        xb, yb = x[start : start + block], y[start : start + block]
        largest = np.argsort(-np.abs(xb), kind="stable")[:kept]
        others = np.setdiff1d(np.arange(xb.size), largest)
        assert np.all(yb[others] == 0.0)
        quantum = np.abs(xb[largest]).max() / 7.0
        assert np.abs(yb[largest] - xb[largest]).max() <= quantum / 2 + 1e-6


def test_topk_costs_a_sixteenth_of_a_byte_per_value_at_the_default_block() -> None:
    x = np.random.default_rng(0).normal(size=1 << 16).astype(np.float32)
    payload = codecs.by_name("topk").encode(x, 256)
    # Per block of 256: a float32 scale, 8 one-byte offsets, 8 four-bit codes.
    assert len(payload) == (1 << 16) // 256 * 16


def test_topk_with_error_feedback_delivers_a_steady_signal() -> None:
    """Values too small to be sent at first grow in the residual until they are: the sum of
    what was decoded converges on the sum of the true deltas, and what is owed is exactly the
    residual."""
    rng = np.random.default_rng(5)
    codec = codecs.by_name("topk")
    ef = codecs.ErrorFeedback(codec, 256)
    signal = rng.normal(size=4096).astype(np.float32)
    sent = np.zeros(4096, np.float64)
    true = np.zeros(4096, np.float64)
    for rounds in range(1, 401):
        delta = (signal + rng.normal(scale=0.5, size=4096)).astype(np.float32)
        true += delta
        sent += codecs.decode_segments(codec, ef.encode(delta), 4096, 256)
        if rounds == 20:
            early = np.linalg.norm(sent / rounds - signal) / np.linalg.norm(signal)
    late = np.linalg.norm(sent / rounds - signal) / np.linalg.norm(signal)
    assert late < 0.1 < early
    assert ef.residual is not None
    np.testing.assert_allclose(true - sent, ef.residual, atol=1e-2)


def test_corrupt_topk_payloads_are_refused() -> None:
    codec = codecs.by_name("topk")
    x = np.linspace(-1, 1, 300, dtype=np.float32)
    payload = codec.encode(x, 64)  # 5 blocks of 2 kept values, 1-byte offsets after the scales
    codec.check(payload, 300, 64)
    with pytest.raises(codecs.CodecError, match="bytes, expected"):
        codec.check(payload[:-1], 300, 64)
    for offsets, why in (([5, 5], "not increasing"), ([9, 3], "not increasing"), ([1, 64], "out")):
        bad = np.frombuffer(payload, np.uint8).copy()
        bad[20:22] = offsets
        with pytest.raises(codecs.CodecError, match="out of their block or not increasing"):
            codec.decode(bad.tobytes(), 300, 64)
        assert why
    negative = np.frombuffer(payload, np.uint8).copy()
    negative[3] |= 0x80
    with pytest.raises(codecs.CodecError, match="negative block scale"):
        codec.check(negative.tobytes(), 300, 64)
    assert codecs.by_wire(codec.wire).name == "topk"


@pytest.mark.parametrize("n", [1, 7, 256, 1001])
@pytest.mark.parametrize("block", [1, 64, 256])
def test_sign_sends_each_values_sign_times_its_blocks_mean_magnitude(n: int, block: int) -> None:
    x = np.random.default_rng(n).standard_t(3, size=n).astype(np.float32)
    codec = codecs.by_name("sign")
    payload = codec.encode(x, block)
    assert len(payload) == 4 * -(-n // block) + (n + 7) // 8
    codec.check(payload, n, block)
    y = codec.decode(payload, n, block)
    assert np.all(np.where(x >= 0, y >= 0, y <= 0))
    for start in range(0, n, block):
        xb, yb = x[start : start + block], y[start : start + block]
        np.testing.assert_allclose(np.abs(yb), np.abs(xb).mean(), rtol=1e-5)


def test_sign_with_error_feedback_delivers_a_steady_signal() -> None:
    rng = np.random.default_rng(6)
    codec = codecs.by_name("sign")
    ef = codecs.ErrorFeedback(codec, 256)
    signal = rng.normal(size=4096).astype(np.float32)
    sent = np.zeros(4096, np.float64)
    for rounds in range(1, 201):
        sent += codecs.decode_segments(codec, ef.encode(signal), 4096, 256)
        if rounds == 1:
            first = np.linalg.norm(sent - signal) / np.linalg.norm(signal)
    late = np.linalg.norm(sent / rounds - signal) / np.linalg.norm(signal)
    assert late < 0.1 < 0.5 < first


def test_corrupt_sign_payloads_are_refused() -> None:
    codec = codecs.by_name("sign")
    payload = codec.encode(np.linspace(-1, 1, 300, dtype=np.float32), 256)
    with pytest.raises(codecs.CodecError, match="bytes, expected"):
        codec.check(payload + b"\0", 300, 256)
    negative = np.frombuffer(payload, np.uint8).copy()
    negative[3] |= 0x80
    with pytest.raises(codecs.CodecError, match="negative block scale"):
        codec.check(negative.tobytes(), 300, 256)
    assert codecs.by_wire(codec.wire).name == "sign"


@pytest.mark.parametrize("name", sorted(codecs.REGISTRY))
def test_segments_decode_to_what_encoding_the_whole_does(name: str) -> None:
    codec = codecs.by_name(name)
    x = np.random.default_rng(11).normal(size=10_000).astype(np.float32)
    segments, decoded = codecs.encode_segments(codec, x, 256, 512)
    assert len(segments) > 1  # several chunks, each of whole blocks but the last
    assert all(s.count % 256 == 0 for s in segments[:-1])
    whole = codec.decode(codec.encode(x, 256), x.size, 256)
    assert decoded.tobytes() == whole.tobytes()
    assert codecs.decode_segments(codec, segments, x.size, 256).tobytes() == whole.tobytes()


def _unpacked_reference(name: str, payload: bytes, n: int, block: int) -> np.ndarray:
    """The fast table decoders, written out value by value: each code unpacked, mapped to
    its level, multiplied by its block's scale (float32 throughout)."""
    nb = -(-n // block)
    scales = np.frombuffer(payload, "<f4", count=nb)
    body = np.frombuffer(payload, np.uint8, offset=4 * nb)
    bits = {"int8": 8, "int4-uniform": 4, "e3m0": 4, "int2": 2, "sign": 1}[name]
    if bits == 8:
        levels = body.view(np.int8).astype(np.float32)
    else:
        shifts = np.arange(0, 8, bits)
        codes = ((body[:, None] >> shifts) & ((1 << bits) - 1)).ravel()[:n]
        if name == "int4-uniform":
            levels = codes.astype(np.float32) - 8.0
        elif name == "int2":
            levels = codes.astype(np.float32) - 1.5
        elif name == "sign":
            levels = codes.astype(np.float32) * 2.0 - 1.0
        else:
            exp = (codes & 7).astype(np.float32)
            magnitude = np.where(exp > 0, np.exp2(exp - 7), 0.0).astype(np.float32)
            levels = np.where(codes & 8, -magnitude, magnitude)
    decoded: np.ndarray = (levels * np.repeat(scales, block)[:n]).astype(np.float32)
    return decoded


@pytest.mark.parametrize("name", ["int8", "int4-uniform", "e3m0", "int2", "sign"])
@pytest.mark.parametrize(
    ("n", "block"), [(0, 256), (1, 1), (7, 3), (1001, 7), (1001, 64), (70_001, 256)]
)
def test_table_decoders_are_bit_identical_to_unpacking_each_value(
    name: str, n: int, block: int
) -> None:
    c = codecs.by_name(name)
    x = np.random.default_rng(n).normal(size=n).astype(np.float32)
    x[: min(n, block)] = 0.0  # a block of zeros: +-0 and zero scales
    payload = c.encode(x, block)
    out = c.decode(payload, n, block)
    assert out.dtype == np.float32
    assert out.tobytes() == _unpacked_reference(name, payload, n, block).tobytes()


@pytest.mark.parametrize("name", sorted(codecs.REGISTRY))
@pytest.mark.parametrize(("n", "block"), [(1, 1), (7, 3), (1001, 7), (150_001, 256)])
def test_decode_into_adds_what_decoding_then_weighing_adds_bit_for_bit(
    name: str, n: int, block: int
) -> None:
    """The synchronizer's accumulator (synchronizer.merge.Accumulator.add): values times
    float32(weight), then added, in float32; decode_into never builds the decoded segment."""
    codec = codecs.by_name(name)
    rng = np.random.default_rng(n)
    x = rng.standard_t(3, size=n).astype(np.float32)
    x[: min(n, block)] = 0.0
    segments, _ = codecs.encode_segments(codec, x, block, 20_000)
    for weight in (1.0, 0.37, -2.5):
        acc = rng.normal(size=n + 5).astype(np.float32)
        expected = acc.copy()
        for s in segments:
            values = codec.decode(s.data, s.count, block)
            squares = float(np.dot(values.astype(np.float64), values))
            np.multiply(values, np.float32(weight), out=values)
            part = expected[s.offset + 5 : s.offset + 5 + s.count]
            np.add(part, values, out=part)
            shifted = codecs.Segment(s.offset + 5, s.count, s.data)
            assert codec.decode_into(acc, weight, shifted, block) == pytest.approx(squares, 1e-5)
        assert acc.tobytes() == expected.tobytes()


def test_int8_squares_of_blocks_longer_than_a_span_are_exact() -> None:
    """The compiled int8 passes sum squares in int32 a span (kernels.SPAN values) at a time;
    a block of the largest size, every code -128, overflows int32 unless each span's sum is
    widened before the next: every pass returns the exact sum of squares."""
    bs = codecs.MAX_BLOCK_SIZE
    n = bs + kernels.SPAN + 3  # a whole block of the largest size, and a short one after it
    codes = np.full(n, -128, np.int8)
    scales = np.array([0.5, 2.0], np.float32)
    want = (bs * 0.25 + (n - bs) * 4.0) * 128.0 * 128.0
    acc = np.zeros(n, np.float32)
    assert kernels.int8_into(acc, np.float32(1.0), codes, scales, bs) == want
    assert acc[0] == -64.0
    assert acc[-1] == -256.0
    assert kernels.int8_squares(codes, scales, bs, n) == want
    squares = np.zeros(kernels.MANY)
    table = np.stack([scales, scales])
    many = kernels.readonly_many([codes, codes])
    kernels.int8_into_many(acc, np.ones(2, np.float32), many, table, bs, 2, squares)
    assert list(squares[:2]) == [want, want]
    assert acc[0] == -192.0


@pytest.mark.parametrize("name", sorted(codecs.REGISTRY))
@pytest.mark.parametrize(("n", "block"), [(1, 64), (1001, 64), (1001, 3), (70_001, 256)])
@pytest.mark.parametrize("many", [1, 3, kernels.MANY + 3])
def test_chunks_of_one_range_summed_together_are_decode_into_each_in_turn_bit_for_bit(
    name: str, n: int, block: int, many: int
) -> None:
    """decode_many of chunks `ready` for one range (several learners' updates), in passes of
    up to kernels.MANY, leaves the sum and returns the squares decode_into of each in turn
    would; ready is None where the codec has no compiled path for the block size."""
    codec = codecs.by_name(name)
    if codec.name in ("int4", "int4-uniform") and block % 2:
        block = 64  # 4-bit codes need blocks of whole bytes to encode at all
    rng = np.random.default_rng(n + many)
    payloads = []
    for _ in range(many):
        x = rng.standard_t(3, size=n).astype(np.float32)
        x[: min(n, block)] = 0.0
        payloads.append(bytes(codec.encode(x, block)))
    weights = [float(w) for w in rng.uniform(0.01, 3.0, size=many)]
    acc = rng.normal(size=n + 5).astype(np.float32)
    want = acc.copy()
    want_squares = [
        codec.decode_into(want, w, codecs.Segment(5, n, p), block)
        for w, p in zip(weights, payloads, strict=True)
    ]
    ready = [
        codec.ready(acc, w, codecs.Segment(5, n, p), block)
        for w, p in zip(weights, payloads, strict=True)
    ]
    compiled = codec.blockwise is not None and codec.blockwise.fused is not None
    if not (compiled and block % codec.blockwise.per_byte == 0):  # type: ignore[union-attr]
        assert all(r is None for r in ready)
        return
    chunks = [r for r in ready if r is not None]
    assert codec.decode_many(acc, 5, n, block, chunks) == want_squares
    assert acc.tobytes() == want.tobytes()


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_chunk_is_ready_only_once_checked_as_decode_into_checks_it(name: str) -> None:
    """ready refuses what decode_into refuses (nothing added), and leaves to decode_into a
    chunk whose squares must be summed before anything is added (its budget is near)."""
    codec = codecs.by_name(name)
    x = np.random.default_rng(5).normal(size=512).astype(np.float32)
    segment = codecs.Segment(0, 512, bytes(codec.encode(x, 64)))
    acc = np.zeros(512, np.float32)
    with pytest.raises(codecs.CodecError, match="could reach"):
        codec.ready(acc, 3.0, segment, 64, limit=1e-3)
    with pytest.raises(codecs.CodecError, match="outside"):
        codec.ready(np.zeros(100, np.float32), 1.0, segment, 64)
    with pytest.raises(codecs.CodecError):
        codec.ready(acc, 1.0, codecs.Segment(0, 512, segment.data[:-1]), 64)
    squares = codec.decode_into(np.zeros(512, np.float32), 1.0, segment, 64)
    assert codec.ready(acc, 1.0, segment, 64, max_squares=1.01 * squares) is None
    assert codec.ready(acc, 1.0, segment, 64, max_squares=1e6 * squares) is not None
    assert not acc.any()


@pytest.mark.parametrize("name", sorted(codecs.REGISTRY))
@pytest.mark.parametrize(("n", "block"), [(1, 64), (1001, 64), (70_001, 256), (4_096, 3)])
def test_a_move_is_taking_out_then_adding_bit_for_bit(name: str, n: int, block: int) -> None:
    """A chunk moved from a sealed round's sum to the next (move_into, decoding once) leaves
    both sums as decode_into at -weight then at weight would; where there is no compiled
    move, it does nothing and says so."""
    codec = codecs.by_name(name)
    if codec.name in ("int4", "int4-uniform") and block % 2:
        block = 64  # 4-bit codes need blocks of whole bytes to encode at all
    rng = np.random.default_rng(n)
    x = rng.standard_t(3, size=n).astype(np.float32)
    segments, _ = codecs.encode_segments(codec, x, block, 20_000)
    moved = False
    for weight in (1.0, 0.37, 3e-5):
        src, dst = (rng.normal(size=n + 5).astype(np.float32) for _ in range(2))
        want_src, want_dst = src.copy(), dst.copy()
        for s in segments:
            shifted = codecs.Segment(s.offset + 5, s.count, s.data)
            codec.decode_into(want_src, -weight, shifted, block)
            codec.decode_into(want_dst, weight, shifted, block)
            if codec.move_into(src, dst, weight, shifted, block):
                moved = True
            else:
                codec.decode_into(src, -weight, shifted, block)
                codec.decode_into(dst, weight, shifted, block)
        assert src.tobytes() == want_src.tobytes()
        assert dst.tobytes() == want_dst.tobytes()
    if codec.float32_payload:
        assert moved  # fp32: the payload's values moved where they lie
        return
    compiled = codec.blockwise is not None and codec.blockwise.fused is not None
    assert moved == (compiled and block % codec.blockwise.per_byte == 0)  # type: ignore[union-attr]


@pytest.mark.parametrize("name", sorted(codecs.REGISTRY))
def test_decode_into_refuses_without_touching_the_accumulator(name: str) -> None:
    codec = codecs.by_name(name)
    x = np.linspace(-1, 1, 300, dtype=np.float32)
    data = codec.encode(x, 64)
    acc = np.ones(400, np.float32)
    refused = [
        (codecs.Segment(0, 300, data[:-1]), 1.0, "expected"),
        (codecs.Segment(101, 300, data), 1.0, "outside"),
        (codecs.Segment(-1, 300, data), 1.0, "outside"),
        (codecs.Segment(0, 300, data), 1e39, "could reach"),  # inf in float32
    ]
    for segment, weight, why in refused:
        with pytest.raises(codecs.CodecError, match=why):
            codec.decode_into(acc, weight, segment, 64)
        assert np.all(acc == 1.0)
    with pytest.raises(codecs.CodecError, match="could reach"):
        codec.decode_into(acc, 3.0, codecs.Segment(0, 300, data), 64, limit=2.0)
    assert np.all(acc == 1.0)


@pytest.mark.parametrize("name", sorted(set(codecs.REGISTRY) - {"int4"}))
def test_a_payload_decodes_the_same_from_a_view_of_the_message_it_arrived_in(
    values: np.ndarray, name: str
) -> None:
    """The synchronizer reads a chunk's payload in place (a memoryview into the received
    message): every codec checks, decodes and sums it as it does the same bytes."""
    codec = codecs.by_name(name)
    payload = codec.encode(values, 64)
    message = b"\x4a" + payload + b"\x50\x01"  # other fields around it
    view = memoryview(message)[1 : 1 + len(payload)]
    codec.check(view, values.size, 64)
    np.testing.assert_array_equal(
        codec.decode(view, values.size, 64), codec.decode(payload, values.size, 64)
    )
    sums = [np.ones(values.size, np.float32) for _ in range(2)]
    data: tuple[codecs.Payload, ...] = (view, payload)
    squares = [
        codec.decode_into(acc, 0.5, codecs.Segment(0, values.size, d), 64)
        for acc, d in zip(sums, data, strict=True)
    ]
    assert squares[0] == squares[1]
    np.testing.assert_array_equal(sums[0], sums[1])
    # A view's bytes that are corrupt are refused as the bytes are.
    broken = bytearray(message)
    broken[1:5] = np.float32(np.nan).tobytes()  # the first block's scale (or first value)
    with pytest.raises(codecs.CodecError):
        codec.decode(memoryview(bytes(broken))[1 : 1 + len(payload)], values.size, 64)


@pytest.mark.parametrize("name", sorted(set(codecs.REGISTRY) - {"int4"}))
def test_decode_into_refuses_a_chunk_over_its_squares_budget_without_touching_the_sum(
    name: str,
) -> None:
    """A budget under the chunk's sum of squares refuses it, the accumulator untouched; one
    at or over it adds the chunk, even where the scales alone allow more (blockwise codecs
    bound the squares by their scales first, and decode to check only past the budget)."""
    codec = codecs.by_name(name)
    x = np.random.default_rng(8).normal(size=3000).astype(np.float32)
    segment = codecs.Segment(0, x.size, codec.encode(x, 64))
    exact = np.zeros(x.size, np.float32)
    squares = codec.decode_into(exact, 0.5, segment, 64)
    acc = np.ones(x.size, np.float32)
    with pytest.raises(codecs.OverSquares) as over:
        codec.decode_into(acc, 0.5, segment, 64, max_squares=0.99 * squares)
    assert over.value.squares == squares  # summed as decode_into sums them
    assert np.all(acc == 1.0)
    assert codec.decode_into(acc, 0.5, segment, 64, max_squares=1.01 * squares) == squares
    assert acc.tobytes() == (np.float32(1.0) + exact).tobytes()
    ample = np.zeros(x.size, np.float32)  # a budget over what the scales allow: one pass
    assert codec.decode_into(ample, 0.5, segment, 64, max_squares=1e3 * squares) == squares
    assert ample.tobytes() == exact.tobytes()


def test_an_int8_code_of_minus_128_is_within_the_bounds_the_scales_give() -> None:
    """The encoder writes -127..127, but a payload's -128 decodes too: the limit and the
    squares budget count it (a bound of 127 would let it through, to be taken out again)."""
    codec = codecs.by_name("int8")
    payload = np.float32(1.0).tobytes() + np.int8(-128).tobytes()
    acc = np.zeros(1, np.float32)
    with pytest.raises(codecs.OverSquares):
        codec.decode_into(acc, 1.0, codecs.Segment(0, 1, payload), 1, max_squares=127.0**2)
    with pytest.raises(codecs.CodecError, match="could reach"):
        codec.decode_into(acc, 1.0, codecs.Segment(0, 1, payload), 1, limit=127.5)
    assert acc[0] == 0.0
    assert codec.decode_into(acc, 1.0, codecs.Segment(0, 1, payload), 1) == 128.0**2
    assert acc[0] == -128.0


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_a_window_of_whole_blocks_decodes_as_the_whole_payload_does(name: str) -> None:
    """`Blockwise.decode_range` (what the owner's sampled checks read) gives the values the
    whole payload's decode gives there, bit for bit, and refuses a start inside a block."""
    codec = codecs.by_name(name)
    assert codec.blockwise is not None
    n, block = 10_000, 256
    x = np.random.default_rng(3).normal(size=n).astype(np.float32)
    payload = codec.encode(x, block)
    whole = codec.decode(payload, n, block)
    for start, stop in ((0, 1024), (2048, 4096), (9984, n)):
        window = codec.blockwise.decode_range(payload, n, block, start, stop)
        np.testing.assert_array_equal(window, whole[start:stop])
    with pytest.raises(ValueError, match="block"):
        codec.blockwise.decode_range(payload, n, block, 100, 200)
