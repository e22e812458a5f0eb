import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax

from learner import mesh


def test_a_leaf_is_cut_along_its_outermost_dimension_the_devices_divide() -> None:
    assert mesh.split_dimension((256, 128), 2) == 0
    assert mesh.split_dimension((3, 128), 2) == 1
    assert mesh.split_dimension((3, 5), 2) is None  # nothing divides: replicated
    assert mesh.split_dimension((), 4) is None
    assert mesh.split_dimension((2, 8), 4) == 1  # 2 < 4 devices: the next dimension
    assert mesh.split_dimension((256, 128), 1) is None  # one device: nothing to split


def test_moments_are_sharded_as_their_parameters() -> None:
    m = mesh.learner_mesh(jax.devices()[:1])
    shapes = {"w": jax.numpy.zeros((4, 6)), "n": jax.numpy.zeros((), "int32")}
    got = mesh.shardings(shapes, m)
    assert got["w"] == mesh.leaf_sharding((4, 6), m)
    assert got["n"].is_fully_replicated


SCRIPT = textwrap.dedent(
    """
    import threading
    import jax
    from learner.loop import InnerLoop
    from learner.settings import LearnerSettings
    from learner.workload import load
    from services.tape import Tape

    assert len(jax.devices()) == 2
    s = LearnerSettings(standalone=True, steps=3, layers=1, width=32, heads=2, context=16,
                        batch_size=4, eval_every=0, eval_batches=1)
    loop = InnerLoop(s, load(s), None, Tape(None, "t"), threading.Event())
    params, opt_state = loop._start()
    loop._compile_step(params, opt_state)
    params, opt_state, loss = loop._train_step(params, opt_state, loop._next_batch())
    qkv = params["blocks/0/attn/qkv"]
    assert not qkv.sharding.is_fully_replicated, qkv.sharding
    assert [s.data.shape for s in qkv.addressable_shards] == [(16, 96), (16, 96)]
    moments = [x for x in jax.tree.leaves(opt_state) if x.shape == qkv.shape]
    assert moments and all(m.sharding == qkv.sharding for m in moments)
    print("loss", float(loss))
    """
)


def test_the_inner_loop_shards_parameters_and_optimizer_state_over_its_devices() -> None:
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        PYTHONPATH=str(Path(__file__).resolve().parents[1]),
    )
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loss" in out.stdout
