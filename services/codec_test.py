import numpy as np
import pytest

from services import codec as codecs


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
        payload = ef.encode(delta)
        sent += codecs.by_name("int8").decode(payload, 640, 64)
    assert ef.residual is not None
    # What is still owed is exactly the residual, and it is below one quantum of the last block.
    np.testing.assert_allclose(true - sent, ef.residual, atol=1e-5)
    last_scale = np.abs(ef.residual).max()
    assert last_scale <= 0.05 / 127 * 2
