"""The device encoders give the numpy encoders' bytes, bit for bit, on whatever platform JAX
has (these run on CPU in CI; the same file runs on a GPU as it is)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from learner import device_codec
from services import codec as codecs

CODECS = ["int8", "int4-uniform"]
TINY = float(np.finfo(np.float32).tiny)
BIG = float(np.finfo(np.float32).max)


def test_reciprocals_are_correctly_rounded_as_ieee_division() -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(1 << 23, 253 << 23, size=1_000_000, dtype=np.uint32)  # normal, < 2^126
    edges = np.array([1.0, 2.0, 0.5, 3.0, 127.0, 7.0, TINY, BIG / 127, BIG / 7], np.float32)
    ones = np.float32(1).view(np.uint32) | np.arange(1 << 12, dtype=np.uint32)  # 1 + tiny steps
    scales = np.concatenate([bits.view(np.float32), edges, ones.view(np.float32)])
    scales = np.concatenate([scales, np.nextafter(scales, np.float32(np.inf)), [0.0]])
    scales = scales.astype(np.float32)
    expected = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales > 0)
    got = np.asarray(jax.jit(device_codec.reciprocal)(scales))
    assert got.tobytes() == expected.tobytes()


def _inputs(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    gaussian = rng.normal(size=n).astype(np.float32)
    heavy = (rng.standard_t(2, size=n) * 1e-3).astype(np.float32)
    mixed = gaussian * np.float32(10.0) ** rng.integers(-40, 38, size=n).astype(np.float32)
    with np.errstate(over="ignore"):
        mixed = np.where(np.isfinite(mixed), mixed, BIG).astype(np.float32)
    huge = np.where(rng.random(n) < 0.5, BIG, -BIG).astype(np.float32) * rng.random(n).astype(
        np.float32
    )
    tiny = (rng.normal(size=n) * TINY * 4).astype(np.float32)  # normal and subnormal values
    zeros = np.zeros(n, np.float32)
    zeros[::3] = -0.0
    # Subnormal values that would round to a nonzero code, were they not flushed: blocks
    # whose scale is just above the smallest normal (int8's and int4's).
    flush = np.where(rng.random(n) < 0.5, -0.9, 0.9).astype(np.float32) * np.float32(TINY)
    flush[::7] *= np.float32(127 * 1.5 / 0.9)
    flush[::11] = np.float32(7 * 1.5 * TINY)
    # Values on the codes' rounding boundaries: k + 1/2 steps of the block's quantum.
    ties = (rng.integers(-254, 255, size=n) / 2).astype(np.float32)
    ties[::97] = 127.0
    return {
        "gaussian": gaussian,
        "heavy": heavy,
        "mixed": mixed,
        "huge": huge,
        "tiny": tiny,
        "zeros": zeros,
        "flush": flush,
        "ties": ties,
        "one": np.full(n, 0.3, np.float32),
    }


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize(("n", "block"), [(1, 1), (7, 3), (256, 256), (1001, 7), (70_001, 256)])
def test_device_encoders_give_the_numpy_bytes(name: str, n: int, block: int) -> None:
    codec = codecs.by_name(name)
    for kind, x in _inputs(n, n).items():
        assert device_codec.encode(codec, x, block) == codec.encode(x, block), kind


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize(
    ("n", "block", "chunk"), [(10_007, 256, 1000), (10_007, 7, 301), (0, 256, 1 << 20)]
)
def test_device_feedback_gives_the_host_feedbacks_segments_round_after_round(
    name: str, n: int, block: int, chunk: int
) -> None:
    """Several segments (of an odd number of values too: int4 packs each on its own), and
    the residual carried over: the same bytes each round, the same residual, the same norms
    to float32 accuracy."""
    codec = codecs.by_name(name)
    sizes = (n // 3, n - n // 3) if n else ()
    host = codecs.ErrorFeedback(codec, block, chunk_bytes=chunk, tensor_sizes=sizes)
    device = device_codec.DeviceFeedback(codec, block, chunk_bytes=chunk, tensor_sizes=sizes)
    rng = np.random.default_rng(n)
    for _ in range(4):
        delta = (rng.standard_t(3, size=n) * 0.01).astype(np.float32)
        expected = host.encode(delta)
        assert device.encode(delta) == expected
        np.testing.assert_allclose(device.norms, host.norms, rtol=1e-6)
        assert n == 0 or len(expected) > 1
    if n:
        assert host.residual is not None
        assert device.residual is not None
        assert device.residual.tobytes() == host.residual.tobytes()


@pytest.mark.parametrize("name", CODECS)
def test_an_update_from_leaves_is_the_update_from_their_difference(name: str) -> None:
    codec = codecs.by_name(name)
    rng = np.random.default_rng(1)
    shapes = [(30, 17), (5,), (4, 3, 2)]
    anchor = [rng.normal(size=s).astype(np.float32) for s in shapes]
    theta = [a + rng.normal(size=a.shape).astype(np.float32) * 0.01 for a in anchor]
    sizes = tuple(a.size for a in anchor)
    host = codecs.ErrorFeedback(codec, 64, chunk_bytes=200, tensor_sizes=sizes)
    device = device_codec.DeviceFeedback(codec, 64, chunk_bytes=200, tensor_sizes=sizes)
    for _ in range(3):
        delta = np.concatenate([(a - t).ravel() for a, t in zip(anchor, theta, strict=True)])
        expected = host.encode(delta)
        got = device.encode_update(
            [jnp.asarray(a) for a in anchor], [jnp.asarray(t) for t in theta]
        )
        assert got == expected
        theta = [t + np.float32(0.001) for t in theta]


@pytest.mark.parametrize("name", CODECS)
def test_a_diverged_update_is_refused_and_the_residual_kept(name: str) -> None:
    codec = codecs.by_name(name)
    device = device_codec.DeviceFeedback(codec, 64)
    device.encode(np.ones(300, np.float32) * 0.01)
    before = device.residual
    bad = np.ones(300, np.float32)
    bad[100] = np.nan
    with pytest.raises(codecs.CodecError, match="NaN or Inf"), np.errstate(invalid="ignore"):
        codecs.ErrorFeedback(codec, 64).encode(bad)
    with pytest.raises(codecs.CodecError, match="NaN or Inf"):
        device.encode(bad)
    assert before is not None
    assert device.residual is not None
    assert device.residual.tobytes() == before.tobytes()


def test_the_residual_goes_to_the_host_and_back() -> None:
    codec = codecs.by_name("int8")
    first = device_codec.DeviceFeedback(codec, 64)
    first.encode(np.linspace(-1, 1, 500, dtype=np.float32))
    second = device_codec.DeviceFeedback(codec, 64)
    second.residual = first.residual
    delta = np.linspace(1, -1, 500, dtype=np.float32)
    assert second.encode(delta) == first.encode(delta)


def test_only_int8_and_int4_encode_on_the_device() -> None:
    assert device_codec.supports(codecs.by_name("int4"))
    assert not device_codec.supports(codecs.by_name("e3m0"))
    with pytest.raises(ValueError, match="no encoder on the device"):
        device_codec.DeviceFeedback(codecs.by_name("topk"), 256)


def test_a_fragment_compiles_one_encoder_whatever_round() -> None:
    """Warming at join, the first encoding (no residual yet) and the later ones share one
    compiled encoder: another compile would land in a later sync, inside the loop's time."""
    codec = codecs.by_name("int4")
    rng = np.random.default_rng(3)
    shapes = [(41, 13), (29,)]
    placed = jax.device_put([rng.normal(size=s).astype(np.float32) for s in shapes])
    anchor = [jnp.copy(a) for a in placed]  # as a learner's join makes them
    sizes = tuple(int(np.prod(s)) for s in shapes)
    device = device_codec.DeviceFeedback(codec, 32, tensor_sizes=sizes)
    before = _compiled_encoders()
    device.warm(anchor)  # as a learner does when it joins: compiled, nothing changed
    assert device.residual is None
    for k in range(3):
        theta = [a + np.float32(0.01 * (k + 1)) for a in anchor]
        device.encode_update(anchor, theta)
        anchor = jax.device_put([np.asarray(t) for t in theta])  # as a reply places them
    assert _compiled_encoders() - before == 1


def _compiled_encoders() -> int:
    return int(device_codec._feedback_on_leaves._cache_size())  # type: ignore[attr-defined]
