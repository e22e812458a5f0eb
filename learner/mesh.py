"""Where a learner's arrays live: one mesh over all its devices, every process's included.

The batch is always split over the mesh's `fsdp` axis. Parameters and the inner optimizer's
state follow the learner's `--param-layout`:

- sharded (the default): fully sharded over the same axis (each device holds 1/N of every
  leaf that divides), and XLA inserts the gathers and reduce-scatters the step needs. A leaf
  is cut along its outermost dimension that the device count divides: then every device's
  share is one contiguous run of the leaf's row-major values, and so of the fragment's flat
  vector, which is what a process sends and receives of each fragment (learner/shards.py).
  A leaf nothing divides (a scalar, an odd-sized vector) is replicated.
- replicated: every leaf whole on every device (classic data-parallel), and XLA all-reduces
  the gradients: per step about one model size crosses the devices each way instead of the
  gathers' several, at the price of N copies of the model and its optimizer state.

The rule is a pure function of a leaf's shape and the layout, so the optimizer's moments
(the parameters' shapes) are placed exactly as their parameters are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from learner.settings import ParamLayout

FSDP = "fsdp"  # the mesh axis the batch (and sharded parameters and their state) split over


def learner_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh over `devices` (default: every device of every process, in process
    order, so each process's devices hold neighbouring shares)."""
    found = list(devices) if devices is not None else jax.devices()
    found.sort(key=lambda d: (d.process_index, d.id))
    # Auto axes: XLA propagates the shardings through the model.
    return Mesh(np.array(found), (FSDP,), axis_types=(AxisType.Auto,))


def split_dimension(shape: Sequence[int], devices: int) -> int | None:
    """The dimension a leaf of `shape` is cut along over `devices`: the outermost one they
    divide (None: replicated)."""
    if devices <= 1:
        return None
    for dim, size in enumerate(shape):
        if size >= devices and size % devices == 0:
            return dim
    return None


def leaf_sharding(
    shape: Sequence[int], mesh: Mesh | AbstractMesh, layout: ParamLayout = "sharded"
) -> NamedSharding:
    """Where a leaf of `shape` lives (the rule reads only the mesh's size: an abstract mesh,
    one without devices, gives the same answer)."""
    dim = None if layout == "replicated" else split_dimension(shape, mesh.shape[FSDP])
    if dim is None:
        return replicated(mesh)
    return NamedSharding(mesh, P(*([None] * dim), FSDP))  # type: ignore[no-untyped-call]


def shardings(tree: Any, mesh: Mesh | AbstractMesh, layout: ParamLayout = "sharded") -> Any:
    """A pytree of shardings for a pytree of arrays (or shapes), leaf by leaf."""
    return jax.tree.map(
        lambda leaf: leaf_sharding(tuple(getattr(leaf, "shape", ())), mesh, layout), tree
    )


def replicated(mesh: Mesh | AbstractMesh) -> NamedSharding:
    return NamedSharding(mesh, P())  # type: ignore[no-untyped-call]


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches: split over the fsdp axis along their first (batch) dimension."""
    return NamedSharding(mesh, P(FSDP))  # type: ignore[no-untyped-call]


def put(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array every process holds whole, placed with `sharding`: each process copies
    only the parts its own devices hold (the copies do not block)."""
    array: jax.Array = jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])
    return array
