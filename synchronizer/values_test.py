"""A value rebuilt from its keyframe and deltas is the one the commits made, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from services import codec as codecs
from services.downlink import apply_delta, encode_delta
from synchronizer.values import VersionGone, delta_names, rebuild


@pytest.mark.parametrize("name", ["int4", "int8", "fp32"])
def test_a_keyframe_plus_its_deltas_is_each_version_bit_for_bit(name: str) -> None:
    codec, block = codecs.by_name(name), 64
    rng = np.random.default_rng(0)
    keyframe = rng.standard_normal(5000).astype(np.float32)
    theta, residual, blobs = keyframe, None, []
    for _ in range(5):
        target = theta + 0.01 * rng.standard_normal(theta.size).astype(np.float32)
        segments, after, residual = encode_delta(theta, target, residual, codec, block, 512)
        # What a learner rebuilds from the segments is what the synchronizer made.
        assert apply_delta(theta, segments, codec, block).tobytes() == after.tobytes()
        theta = after
        blobs.append(codecs.pack_segments(segments))
    assert rebuild(keyframe, blobs, codec, block).tobytes() == theta.tobytes()
    assert rebuild(keyframe, [], codec, block).tobytes() == keyframe.tobytes()


def test_the_deltas_are_named_in_order_and_a_gap_is_an_error() -> None:
    entries = [{"version": v, "delta": f"d{v}"} for v in (5, 3, 4, 6)]
    assert delta_names(entries, 2, 6) == ["d3", "d4", "d5", "d6"]
    assert delta_names(entries, 4, 5) == ["d5"]
    with pytest.raises(VersionGone, match=r"\[2\]"):
        delta_names(entries, 1, 4)
