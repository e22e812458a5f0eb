"""The fragment layout: which leaves of the parameter pytree form fragment p.

A pure function of the leaves' names and shapes and of P, so a learner and every
synchronizer replica compute the same layout without exchanging it.

Leaves are grouped into units: all leaves of one layer (a name with a numeric path
component, `blocks/3/...`) form one unit, every other leaf is a unit of its own. Units are
assigned largest first to the lightest fragment (ties to the lowest index). Equal-sized
layers therefore land strided (layer l in fragment l mod P), as Streaming DiLoCo does, and
the loads stay balanced. A layer larger than the ideal fragment size is split into its
leaves, so no fragment is forced over it by one unit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

_LAYER = re.compile(r"(?:^|/)(\d+)(?:/|$)")
SUPPORTED_DTYPES = ("float32", "bfloat16")


class LayoutError(ValueError):
    """The parameter spec cannot be split as asked."""


@dataclass(frozen=True)
class LeafSpec:
    """One leaf of the parameter pytree."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Fragment:
    index: int
    leaves: tuple[LeafSpec, ...]

    @property
    def num_elements(self) -> int:
        return sum(leaf.size for leaf in self.leaves)


@dataclass(frozen=True)
class FragmentLayout:
    fragments: tuple[Fragment, ...]

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def gather(self, index: int, leaves: Mapping[str, np.ndarray]) -> np.ndarray:
        """Concatenate fragment `index`'s leaves into one flat float32 vector."""
        parts = [
            np.asarray(leaves[leaf.name], np.float32).ravel()
            for leaf in self.fragments[index].leaves
        ]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def scatter(self, index: int, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Split a flat vector of fragment `index` back into its leaves (float32)."""
        fragment = self.fragments[index]
        if flat.size != fragment.num_elements:
            raise LayoutError(
                f"fragment {index} holds {fragment.num_elements} values, got {flat.size}"
            )
        out: dict[str, np.ndarray] = {}
        offset = 0
        for leaf in fragment.leaves:
            out[leaf.name] = flat[offset : offset + leaf.size].reshape(leaf.shape)
            offset += leaf.size
        return out


def _layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def validate_specs(specs: Sequence[LeafSpec]) -> None:
    """Refuse specs no layout can serve, with a reason a person can act on."""
    if not specs:
        raise LayoutError("the parameter spec is empty: the model has no leaves")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise LayoutError("the parameter spec names a leaf twice; leaf names must be unique")
    for spec in specs:
        if spec.dtype not in SUPPORTED_DTYPES:
            raise LayoutError(
                f"leaf {spec.name!r} has dtype {spec.dtype!r}; supported: {SUPPORTED_DTYPES}"
            )
        if any(d < 0 for d in spec.shape):
            raise LayoutError(f"leaf {spec.name!r} has a negative dimension {spec.shape}")


def fragment_layout(specs: Iterable[LeafSpec], num_fragments: int) -> FragmentLayout:
    """Split `specs` into `num_fragments` fragments of near-equal size, deterministically."""
    ordered = sorted(specs, key=lambda s: s.name)
    validate_specs(ordered)
    if num_fragments < 1:
        raise LayoutError(f"fragments must be at least 1, got {num_fragments}")
    if num_fragments > len(ordered):
        raise LayoutError(
            f"{num_fragments} fragments asked for a model of {len(ordered)} leaves; "
            "use at most one fragment per leaf"
        )
    ideal = sum(s.size for s in ordered) / num_fragments

    units: dict[tuple[int, str], list[LeafSpec]] = {}
    for spec in ordered:
        layer = _layer_of(spec.name)
        key = (layer, "") if layer is not None else (-1, spec.name)
        units.setdefault(key, []).append(spec)
    split: list[tuple[int, list[LeafSpec]]] = []
    for (layer, _), leaves in units.items():
        if layer >= 0 and sum(s.size for s in leaves) > ideal:
            split.extend((layer, [leaf]) for leaf in leaves)
        else:
            split.append((layer, leaves))
    # Largest first; among equals, lower layer first, so equal layers go strided.
    split.sort(key=lambda u: (-sum(s.size for s in u[1]), u[0], u[1][0].name))

    loads = [0] * num_fragments
    members: list[list[LeafSpec]] = [[] for _ in range(num_fragments)]
    for _, leaves in split:
        target = min(range(num_fragments), key=lambda i: (loads[i], i))
        members[target].extend(leaves)
        loads[target] += sum(s.size for s in leaves)
    if any(not m for m in members):
        raise LayoutError(
            f"{num_fragments} fragments leave one empty for this model; use fewer fragments"
        )
    return FragmentLayout(
        tuple(Fragment(i, tuple(sorted(m, key=lambda s: s.name))) for i, m in enumerate(members))
    )
