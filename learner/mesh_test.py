import json
import math
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

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


def test_the_layout_splits_leaves_over_the_devices_or_keeps_each_whole_on_every_one() -> None:
    two = AbstractMesh((2,), (mesh.FSDP,), axis_types=(AxisType.Auto,))
    params = {"w": jnp.zeros((4, 6)), "v": jnp.zeros((3, 8)), "b": jnp.zeros(3)}
    opt_state = jax.eval_shape(optax.adamw(1e-3).init, params)
    sharded = mesh.shardings(params, two)  # the default: as before
    assert sharded["w"].spec == P(mesh.FSDP)  # type: ignore[no-untyped-call]
    assert sharded["v"].spec == P(None, mesh.FSDP)  # type: ignore[no-untyped-call]
    assert sharded["b"].is_fully_replicated  # nothing divides 3
    assert not all(s.is_fully_replicated for s in jax.tree.leaves(mesh.shardings(opt_state, two)))
    for tree in (params, opt_state):
        whole = jax.tree.leaves(mesh.shardings(tree, two, "replicated"))
        assert whole
        assert all(s.is_fully_replicated for s in whole)


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


TWO_PROCESSES = textwrap.dedent(
    """
    import json, threading
    from learner import group
    from learner.settings import LearnerSettings

    model = dict(standalone=True, processes=2, steps=4, layers=1, width=32, heads=2,
                 context=16, batch_size=4, eval_every=0, eval_batches=1, warmup_steps=0)
    first = LearnerSettings(**model)
    joined = group.start(first.coordinator, first.processes, first.process_id)
    from learner.loop import InnerLoop
    from learner.workload import load
    from services.tape import Tape

    for layout in ("sharded", "replicated"):
        s = LearnerSettings(**model, param_layout=layout)
        loop = InnerLoop(s, load(s), None, Tape(None, "t"), threading.Event())
        params, opt_state = loop._start()
        loop._compile_step(params, opt_state)
        losses = []
        for _ in range(s.steps):
            params, opt_state, loss = loop._train_step(params, opt_state, loop._next_batch())
            losses.append(float(loss))
        qkv = params["blocks/0/attn/qkv"]
        held = [list(x.data.shape) for x in qkv.addressable_shards]
        print("layout", json.dumps({"layout": layout, "held": held, "losses": losses}))
    joined.leave()
    """
)


def test_two_processes_train_alike_with_parameters_sharded_or_replicated() -> None:
    """One learner over two processes (one CPU device each, jax.distributed): the same
    seed and batches give the same losses whether its parameters are split over the two or
    whole on both (the step gathers them, or all-reduces the gradients)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    children = []
    for k in range(2):
        env = dict(os.environ)
        env.update(
            JAX_PLATFORMS="cpu",
            ATOLL_COORDINATOR=coordinator,
            ATOLL_PROCESS_ID=str(k),
            PYTHONPATH=str(Path(__file__).resolve().parents[1]),
        )
        env.pop("XLA_FLAGS", None)
        children.append(
            subprocess.Popen(
                [sys.executable, "-c", TWO_PROCESSES],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    runs = []
    for child in children:
        out, err = child.communicate(timeout=240)
        assert child.returncode == 0, err[-3000:]
        lines = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("layout ")]
        runs.append({r["layout"]: r for r in lines})
    for run in runs:  # each process: half of qkv's rows, or all of them
        assert run["sharded"]["held"] == [[16, 96]]
        assert run["replicated"]["held"] == [[32, 96]]
    sharded, replicated = runs[0]["sharded"]["losses"], runs[0]["replicated"]["losses"]
    assert runs[1]["replicated"]["losses"] == replicated  # one learner: one loss
    assert sharded[-1] < sharded[0]  # it trains
    assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(sharded, replicated, strict=True))
