"""Each learner's last value of something on a fragment (its last update's weight, or its
norm with the inner steps it covered), kept in sorted runs: the median of every other
learner's value, as an update is admitted, without a sort of them all.

An owner caps each update against the median of the other learners' last weights, and
bounds its norm by the median of their last norms, each scaled to the update's steps. Done
by listing and sorting every learner's value, that was O(L log L) Python work per update
for L learners, so O(L^2 log L) per round of the job's learners: 0.5 ms an update at 1,000
learners, on the event loop that receives every chunk. Here the values stay sorted, in one
run per key (the steps an update covered: they differ from update to update), and the
median is selected across the runs with a scale per run, in O(R^2 log^2 L) for R runs.
The result is the very float a sort of the scaled values would give.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Mapping


def kth_smallest(runs: list[tuple[float, list[float]]], k: int) -> float:
    """The k-th smallest (from 0) of `factor * x` over every run (factor, xs), each xs sorted
    ascending and each factor positive (so each run stays sorted once scaled)."""
    total = sum(len(xs) for _, xs in runs)
    if not 0 <= k < total:
        raise IndexError(f"k={k} is outside the {total} values")
    if len(runs) == 1:  # one run: sorted already
        factor, xs = runs[0]
        return factor * xs[k]
    lo = [0] * len(runs)
    hi = [len(xs) for _, xs in runs]
    while True:
        # The pivot: the middle candidate of the run with the most left, so that run at
        # least halves each time round.
        g = max(range(len(runs)), key=lambda i: hi[i] - lo[i])
        factor, xs = runs[g]
        pivot = factor * xs[(lo[g] + hi[g]) // 2]
        below, upto = [], []
        for (f, ys), a, b in zip(runs, lo, hi, strict=True):
            key = _times(f)
            below.append(bisect.bisect_left(ys, pivot, a, b, key=key))
            upto.append(bisect.bisect_right(ys, pivot, a, b, key=key))
        less = sum(x - a for x, a in zip(below, lo, strict=True))
        equal = sum(x - a for x, a in zip(upto, lo, strict=True)) - less
        if k < less:
            hi = below
        elif k < less + equal:
            return pivot
        else:
            k -= less + equal
            lo = upto


def _times(factor: float) -> Callable[[float], float]:
    return lambda y: factor * y


def _unit(_: int) -> float:
    return 1.0


class Recent:
    """Each learner's last value, with the key it came under (its update's inner steps; 0
    where none matters), in one sorted run per key."""

    def __init__(self, values: Mapping[str, float] | None = None) -> None:
        self._by: dict[str, tuple[float, int]] = {}
        self._runs: dict[int, list[float]] = {}
        for learner, value in (values or {}).items():
            self.set(learner, value)

    def set(self, learner: str, value: float, key: int = 0) -> None:
        if not math.isfinite(value):
            raise ValueError(f"learner {learner!r}'s value {value} is not finite")
        self._drop(learner)
        self._by[learner] = (value, key)
        bisect.insort(self._runs.setdefault(key, []), value)

    def _drop(self, learner: str) -> tuple[float, int] | None:
        old = self._by.pop(learner, None)
        if old is not None:
            run = self._runs[old[1]]
            del run[bisect.bisect_left(run, old[0])]  # one of equal values: the same run
            if not run:
                del self._runs[old[1]]
        return old

    def discard(self, learner: str) -> None:
        """Forget `learner`'s value, if any."""
        self._drop(learner)

    def get(self, learner: str) -> float | None:
        old = self._by.get(learner)
        return None if old is None else old[0]

    def __getitem__(self, learner: str) -> float:
        return self._by[learner][0]

    def __contains__(self, learner: object) -> bool:
        return learner in self._by

    def __len__(self) -> int:
        return len(self._by)

    def items(self) -> Iterator[tuple[str, tuple[float, int]]]:
        return iter(self._by.items())

    def median_of_others(
        self, learner: str, factor: Callable[[int], float] = _unit
    ) -> float | None:
        """The median of every other learner's value times `factor(its key)` (a positive
        scale), as `statistics.median` of those products gives it; None if there are no
        others."""
        own = self._drop(learner)  # out for the question, back after it
        try:
            runs = [(factor(key), run) for key, run in self._runs.items()]
            n = len(self._by)
            if n == 0:
                return None
            if n % 2:
                return kth_smallest(runs, n // 2)
            return (kth_smallest(runs, n // 2 - 1) + kth_smallest(runs, n // 2)) / 2
        finally:
            if own is not None:
                self.set(learner, *own)
