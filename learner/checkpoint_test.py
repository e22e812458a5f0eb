from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from learner import checkpoint as ckpt
from learner.device_codec import DeviceFeedback
from learner.outer import FragmentState
from services import codec as codecs


def _fragment(version: int, on_device: bool = False) -> FragmentState:
    feedback = DeviceFeedback if on_device else codecs.ErrorFeedback
    return FragmentState(
        np.full(3, float(version), np.float32),
        version,
        feedback(codecs.by_name("int8"), 256, tensor_sizes=()),
    )


@pytest.mark.parametrize("on_device", [False, True])
def test_a_checkpoint_round_trips_every_field(tmp_path: Path, on_device: bool) -> None:
    """With the update encoded on the device, the residual and the fragment the update took
    stay there until a checkpoint copies them."""
    f = _fragment(4, on_device)
    f.count(tokens=100, seconds=0.5)
    send = f.begin_send()
    f.encode(send, np.array([1.0, -2.0, 0.5], np.float32))  # in flight, with a residual
    if on_device:
        f.sent_theta = jnp.array([1.0, -2.0, 0.5], jnp.float32)
    f.count(tokens=100, seconds=0.25)
    arrays: dict[str, np.ndarray] = {}
    records = [ckpt.fragment_record(0, f, arrays)]
    ckpt.encoder_arrays(0, ckpt.encoder_held(f, in_flight=True), arrays)
    assert all(isinstance(a, np.ndarray) for a in arrays.values())
    snap = ckpt.Snapshot(
        meta={
            "job": "j",
            "learner": "l0",
            "fragments": 1,
            "step": 7,
            "tokens": 700,
            "position": 9,
        },
        params={"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
        opt_leaves=[np.zeros(2, np.float32), np.asarray(3, np.int32)],
        fragments=records,
        arrays=arrays,
    )
    ckpt.Slots(tmp_path / "l0.checkpoint").write(snap)
    loaded = ckpt.Slots(tmp_path / "l0.checkpoint").read()
    assert loaded is not None
    assert ckpt.matches(loaded, {"job": "j", "learner": "l0", "fragments": 1}, ["w"]) is None
    assert "job" in (ckpt.matches(loaded, {"job": "other"}, ["w"]) or "")
    assert ckpt.matches(loaded, {"job": "j"}, ["w", "b"]) == "the model's parameters differ"
    np.testing.assert_array_equal(loaded.params["w"], snap.params["w"])
    assert [x.tolist() for x in loaded.opt_leaves] == [[0.0, 0.0], 3]
    g = _fragment(0, on_device)
    ckpt.restore_fragment(0, g, loaded.fragments[0], loaded.arrays)
    assert (g.version, g.steps, g.tokens, g.compute_seconds) == (4, 1, 100, 0.25)
    assert g.awaiting_above == f.awaiting_above
    assert g.sent_theta is not None
    assert f.sent_theta is not None
    np.testing.assert_array_equal(g.sent_theta, f.sent_theta)
    assert g.feedback.residual is not None
    assert f.feedback.residual is not None
    np.testing.assert_array_equal(g.feedback.residual, f.feedback.residual)
    np.testing.assert_array_equal(g.base, f.base)


def _snapshot(step: int, width: int = 3) -> ckpt.Snapshot:
    return ckpt.Snapshot(
        meta={"job": "j", "step": step},
        params={"w": np.full(width, float(step), np.float32)},
        opt_leaves=[np.asarray(step, np.int32)],
        fragments=[],
        arrays={},
    )


def test_the_newest_whole_checkpoint_wins_and_a_torn_one_is_skipped(tmp_path: Path) -> None:
    stem = tmp_path / "l0.checkpoint"
    assert ckpt.Slots(stem).read() is None
    writer = ckpt.Slots(stem)
    for step in (1, 2, 3):
        writer.write(_snapshot(step))
    loaded = ckpt.Slots(stem).read()
    assert loaded is not None
    assert loaded.meta["step"] == 3
    # A kill in the middle of writing step 4 (into the file that held step 2): its body is
    # half new, its header still step 2's. The file fails its checksum; step 3 is read.
    older = writer.paths[0]
    data = bytearray(older.read_bytes())
    data[ckpt.HEADER.size + 10] ^= 0xFF
    older.write_bytes(bytes(data))
    loaded = ckpt.Slots(stem).read()
    assert loaded is not None
    assert loaded.meta["step"] == 3
    # A new writer goes on after the newest whole one and never overwrites it.
    again = ckpt.Slots(stem)
    again.write(_snapshot(4, width=2))  # a shorter body: the file is cut to its length
    loaded = ckpt.Slots(stem).read()
    assert loaded is not None
    assert loaded.meta["step"] == 4
    assert loaded.params["w"].tolist() == [4.0, 4.0]
    writer.paths[1].write_bytes(b"not a checkpoint")
    loaded = ckpt.Slots(stem).read()
    assert loaded is not None
    assert loaded.meta["step"] == 4


def test_the_body_is_a_safetensors_file(tmp_path: Path) -> None:
    from safetensors.numpy import load

    ckpt.Slots(tmp_path / "l0.checkpoint").write(_snapshot(5))
    path = tmp_path / "l0.checkpoint.1"
    body = path.read_bytes()[ckpt.HEADER.size :]
    arrays = load(body)
    assert arrays["param/w"].tolist() == [5.0, 5.0, 5.0]
    assert arrays["opt/0"].shape == ()


def test_a_checkpoint_over_2_gib_round_trips(tmp_path: Path) -> None:
    """One write call moves at most 0x7ffff000 bytes on Linux: the body must not be cut."""
    big = np.empty(550_000_000, np.float32)  # 2.2 GB
    big.fill(1.5)
    big[-1] = 7.0
    snap = ckpt.Snapshot(
        meta={"job": "j", "step": 1},
        params={"w": big},
        opt_leaves=[np.asarray(1, np.int32)],
        fragments=[],
        arrays={},
    )
    stem = tmp_path / "l0.checkpoint"
    try:
        ckpt.Slots(stem).write(snap)
        del snap, big
        assert (stem.with_name("l0.checkpoint.1")).stat().st_size > 0x7FFFF000
        loaded = ckpt.Slots(stem).read()
        assert loaded is not None
        w = loaded.params["w"]
        assert w.shape == (550_000_000,)
        assert w[-1] == 7.0
        assert w[0] == 1.5
        assert np.count_nonzero(w == 1.5) == w.size - 1
    finally:
        for path in tmp_path.iterdir():
            path.unlink()
