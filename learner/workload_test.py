from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from learner.data import Batches
from learner.workload import Workload


def _workload(params: Any) -> Workload:
    return Workload(
        params=params,
        loss_fn=lambda p, b: jnp.sum(p["w"]),
        batches=Batches(np.zeros(64, np.uint8), 2, 4, seed=0),
        eval_batches=[],
        tokens_per_batch=8,
    )


def test_parameters_made_by_a_function_are_made_once_and_only_when_needed() -> None:
    calls = []

    def make() -> dict[str, Any]:
        calls.append(1)
        return {"w": jnp.ones((2, 3), jnp.float32)}

    w = _workload(make)
    shapes = w.shapes()  # traced abstractly: no array is made
    assert isinstance(shapes["w"], jax.ShapeDtypeStruct)
    assert shapes["w"].shape == (2, 3)
    assert shapes["w"].dtype == jnp.float32
    traced = len(calls)
    first = w.initial()
    assert w.initial() is first
    assert len(calls) == traced + 1, "the values are made once"
    np.testing.assert_array_equal(first["w"], np.ones((2, 3), np.float32))


def test_parameters_given_as_arrays_give_their_shapes() -> None:
    w = _workload({"w": np.zeros((4,), np.float32)})
    assert w.shapes()["w"].shape == (4,)
    assert w.initial()["w"].shape == (4,)
