"""Where a learner's arrays live: one mesh over all its devices, every process's included.

Parameters and the inner optimizer's state are fully sharded over the mesh's `fsdp` axis
(each device holds 1/N of every leaf that divides); the batch is split over the same axis,
and XLA inserts the gathers and reduce-scatters the step needs. A leaf is cut along its
outermost dimension that the device count divides: then every device's share is one
contiguous run of the leaf's row-major values, and so of the fragment's flat vector, which
is what a process sends and receives of each fragment (learner/shards.py). A leaf nothing
divides (a scalar, an odd-sized vector) is replicated.

The rule is a pure function of a leaf's shape, so the optimizer's moments (the parameters'
shapes) are sharded exactly as their parameters are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

FSDP = "fsdp"  # the mesh axis parameters, optimizer state and the batch are split over


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


def leaf_sharding(shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    dim = split_dimension(shape, mesh.shape[FSDP])
    if dim is None:
        return NamedSharding(mesh, P())  # type: ignore[no-untyped-call]
    return NamedSharding(mesh, P(*([None] * dim), FSDP))  # type: ignore[no-untyped-call]


def shardings(tree: Any, mesh: Mesh) -> Any:
    """A pytree of shardings for a pytree of arrays (or shapes), leaf by leaf."""
    return jax.tree.map(lambda leaf: leaf_sharding(tuple(getattr(leaf, "shape", ())), mesh), tree)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())  # type: ignore[no-untyped-call]


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches: split over the fsdp axis along their first (batch) dimension."""
    return NamedSharding(mesh, P(FSDP))  # type: ignore[no-untyped-call]


def put(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array every process holds whole, placed with `sharding`: each process copies
    only the parts its own devices hold (the copies do not block)."""
    array: jax.Array = jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])
    return array
