"""Which values of each fragment one process of a learner holds, sends and receives.

A fragment is a flat vector: its leaves' row-major values back to back (services/layout.py).
Each leaf is sharded over the learner's mesh (learner/mesh.py), so a process's devices hold
some runs of each leaf's values. A process's *vector* of a fragment is the values it holds,
in fragment order: what its error feedback, anchors and adopted global values are kept as,
never the whole fragment. Of those it *sends* the runs whose shard its own device is the
first to hold (a value held on several devices, a replicated leaf, goes from one: with
`--param-layout replicated` every leaf is, and the first process sends every fragment whole);
the processes that send anything for a fragment send one part each of its update
(`UpdateChunk.part` of `parts`), and together their parts cover it exactly.

Pure: it reads shard indices (as `Sharding.devices_indices_map` gives them) and devices'
ids and processes, nothing else, so every process computes every other's plan alike.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.layout import FragmentLayout

Index = tuple[tuple[int, int], ...]  # a shard's (start, stop) along each dimension


class Device(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def process_index(self) -> int: ...


@dataclass(frozen=True)
class Piece:
    """One shard of one leaf held on this process: the devices holding it, its shape, and
    where its row-major values sit in the process's vector: (vector offset, count) runs."""

    leaf: str
    devices: tuple[Any, ...]
    shape: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class FragmentShard:
    """This process's share of one fragment."""

    fragment: int
    size: int  # values of the whole fragment
    held: tuple[tuple[int, int], ...]  # (fragment offset, count) runs, increasing
    sent: tuple[tuple[int, int], ...]  # the runs it sends (some of `held`)
    sent_local: tuple[tuple[int, int], ...]  # the same runs as (vector offset, count)
    pieces: tuple[Piece, ...]
    part: int  # its part of the fragment's updates (0 when it sends none)
    parts: int  # processes that send a part

    @property
    def length(self) -> int:
        """Values in this process's vector."""
        return sum(c for _, c in self.held)


def normalize(index: Sequence[slice], shape: Sequence[int]) -> Index:
    """A shard index as (start, stop) per dimension."""
    full = [*index, *[slice(None)] * (len(shape) - len(index))]
    return tuple(
        (s.start or 0, n if s.stop is None else s.stop) for s, n in zip(full, shape, strict=True)
    )


def runs(shape: Sequence[int], index: Index) -> list[tuple[int, int]]:
    """The (leaf offset, count) runs a shard covers, in its row-major order (increasing)."""
    if not shape:
        return [(0, 1)]
    cut = [d for d, (a, b) in enumerate(index) if (a, b) != (0, shape[d])]
    if not cut:
        return [(0, math.prod(shape))]
    last = cut[-1]
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    length = (index[last][1] - index[last][0]) * strides[last]
    starts = [index[last][0] * strides[last]]
    for d in reversed(range(last)):
        a, b = index[d]
        starts = [i * strides[d] + s for i in range(a, b) for s in starts]
    return [(s, length) for s in starts if length]


def _joined(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for offset, count in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + count)
        else:
            out.append((offset, count))
    return out


def _locator(held: list[tuple[int, int]]) -> Callable[[int], int]:
    """Where a fragment offset inside `held` sits in the vector of those runs."""
    starts = [s for s, _ in held]
    at = [0]
    for _, n in held:
        at.append(at[-1] + n)

    def local_of(offset: int) -> int:
        i = bisect_right(starts, offset) - 1
        return at[i] + offset - starts[i]

    return local_of


def plan(
    layout: FragmentLayout,
    indices: Mapping[str, Mapping[Any, Any]],
    process: int,
) -> list[FragmentShard]:
    """Every fragment's share for `process`; `indices[leaf]` maps every device of the mesh
    (any process's) to the index of the leaf's shard it holds."""
    out = []
    for fragment in layout.fragments:
        held: list[tuple[int, int]] = []
        sent: list[tuple[int, int]] = []
        senders: set[int] = set()
        mine: list[tuple[str, tuple[Any, ...], tuple[int, ...], list[tuple[int, int]]]] = []
        base = 0
        for leaf in fragment.leaves:
            holders: dict[Index, list[Any]] = {}
            for device, where in indices[leaf.name].items():
                holders.setdefault(normalize(where, leaf.shape), []).append(device)
            for index, devices in holders.items():
                devices.sort(key=lambda d: (d.process_index, d.id))
                leaf_runs = [(base + s, n) for s, n in runs(leaf.shape, index)]
                senders.add(devices[0].process_index)
                if devices[0].process_index == process:
                    sent += leaf_runs
                local = tuple(d for d in devices if d.process_index == process)
                if local:
                    held += leaf_runs
                    shape = tuple(b - a for a, b in index)
                    mine.append((leaf.name, local, shape, leaf_runs))
            base += leaf.size
        held_runs = _joined(held)
        local_of = _locator(held_runs)
        pieces = tuple(
            Piece(name, devices, shape, tuple((local_of(s), n) for s, n in leaf_runs))
            for name, devices, shape, leaf_runs in mine
        )
        sent_runs = _joined(sent)
        order = sorted(senders)
        out.append(
            FragmentShard(
                fragment=fragment.index,
                size=fragment.num_elements,
                held=tuple(held_runs),
                sent=tuple(sent_runs),
                sent_local=tuple((local_of(s), n) for s, n in sent_runs),
                pieces=pieces,
                part=order.index(process) if process in senders else 0,
                parts=len(order),
            )
        )
    return out
