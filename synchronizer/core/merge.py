"""How a round combines outer gradients, summed as they arrive, and the outer step.

Pure numpy over float32 arrays; no JAX (the synchronizer never touches an accelerator).
A merge rule is a registry entry (`MERGE_RULES`): it makes the accumulator an owner sums
each update into, chunk by chunk, and turns the summed round into the outer gradient.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from services.blockwise import check_squares
from services.codec import Codec, Ready, Segment


def token_weight(c_tokens: int, c_steps: int) -> float:
    """w = c_tokens^2 / c_steps: quantity (tokens) times quality (tokens per step)."""
    if c_steps <= 0 or c_tokens <= 0:
        return 0.0
    return float(c_tokens) ** 2 / float(c_steps)


def staleness_weight(staleness: int, decay: float) -> float:
    """decay^staleness: an update `staleness` versions behind counts that much less."""
    return float(decay) ** max(0, staleness)


def capped_weights(
    weights: Sequence[float], provisional: Sequence[bool], share: float
) -> list[float]:
    """A sealed round's weights. A provisional weight (its update had no other learner's
    update to be capped against when it began) becomes at most `share` times the median
    weight of the round's other members, as they claimed or were capped; the others keep
    theirs (capped when they began). One member alone keeps its own: it is the whole round."""
    out = list(weights)
    for i, weight in enumerate(weights):
        others = [w for j, w in enumerate(weights) if j != i]
        if provisional[i] and others:
            out[i] = min(weight, share * statistics.median(others))
    return out


def partial_round_scale(contributors: int, live_learners: int) -> float:
    """How much of a full outer step a round takes: contributors / live learners (at most 1).

    A live learner missing from a round counts as an outer gradient of zero at the
    contributors' mean weight: its progress enters a later round instead. A full round is
    plain DiLoCo; M one-learner rounds add up to one averaged step, not M full ones (which
    overshoot, momentum compounding them).
    """
    if contributors <= 0:
        return 0.0
    return min(1.0, contributors / max(1, live_learners))


def live_round_scale(members: AbstractSet[str], live: AbstractSet[str] | None) -> float:
    """A round's step as a share of a full one: its member slots over the live learners it
    stands for (`partial_round_scale`), its members counted among them (each was live when
    admitted; one that left since still takes only its share). None: full rounds. Never a
    full step for a member beside live learners outside the round."""
    if live is None:
        return 1.0
    return partial_round_scale(len(members), len(live | members))


def tensor_norms(values: np.ndarray, segments: Sequence[int]) -> list[float]:
    """The L2 norm of each tensor (a run of `segments` sizes) of a flat fragment."""
    out, start = [], 0
    for size in segments or [values.size]:
        out.append(float(np.linalg.norm(values[start : start + size].astype(np.float64))))
        start += size
    return out


@dataclass
class Accumulator:
    """The running sum of one round of one fragment (mean rule: sum of w * delta)."""

    size: int
    segments: tuple[int, ...]  # tensor sizes, in layout order
    total: np.ndarray = field(init=False)
    weight: float = 0.0
    # The round's provisional updates summed apart at the weights they claimed (owner.py),
    # until the round is sealed and their weights are known; None while it has none.
    provisional: Accumulator | None = field(default=None, init=False, repr=False, compare=False)
    # The largest weight taken out of this sum again (a refused or moved update): where
    # weights are unbounded, what is left may have lost the others' float32 bits (owner.py).
    taken_out: float = field(default=0.0, init=False, compare=False)
    # Whether a chunk moves to another sum in one compiled pass (`move_encoded`).
    compiled_moves: ClassVar[bool] = True
    # Whether chunks of one range are summed several at once (`ready_encoded`, `add_many`).
    sums_together: ClassVar[bool] = True
    # Whether an update is clipped by scaling its values in the sum (the mean rule); else by
    # scaling the norms it is counted with (`counted`), its direction kept (radial).
    clips_values: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.total = np.zeros(self.size, np.float32)

    def add(self, offset: int, values: np.ndarray, weight: float, norms: Sequence[float]) -> None:
        """Add one decoded chunk of an update weighing `weight` (values are scratch)."""
        np.multiply(values, np.float32(weight), out=values)
        part = self.total[offset : offset + values.size]
        np.add(part, values, out=part)

    def subtract(
        self, offset: int, values: np.ndarray, weight: float, norms: Sequence[float]
    ) -> None:
        """Take one chunk added earlier out again (an update refused after summing)."""
        np.multiply(values, np.float32(-weight), out=values)
        part = self.total[offset : offset + values.size]
        np.add(part, values, out=part)

    def add_encoded(
        self,
        segment: Segment,
        codec: Codec,
        block_size: int,
        weight: float,
        norms: Sequence[float],
        limit: float,
        max_squares: float = math.inf,
    ) -> float:
        """Decode one chunk and add it weighing `weight` (negative: take it out again), in
        one pass per cache-sized piece; returns its unweighted sum of squares. Raises
        CodecError, the sum untouched, for a bad payload or values that times the weight
        could pass `limit`; OverSquares, the sum untouched, for values whose sum of squares
        passes `max_squares`."""
        return codec.decode_into(self.total, weight, segment, block_size, limit, max_squares)

    def ready_encoded(
        self,
        segment: Segment,
        codec: Codec,
        block_size: int,
        weight: float,
        limit: float,
        max_squares: float = math.inf,
    ) -> Ready | None:
        """`add_encoded`'s checks of one chunk, nothing added: CodecError as it raises it.
        The chunk is then added with others of its range by `add_many`. None where it goes
        alone through `add_encoded` (Codec.ready)."""
        if not self.sums_together:
            return None
        return codec.ready(self.total, weight, segment, block_size, limit, max_squares)

    def add_many(
        self, offset: int, count: int, codec: Codec, block_size: int, chunks: list[Ready]
    ) -> list[float]:
        """`add_encoded` of each `ready_encoded` chunk of one range in turn, bit for bit,
        each block of the sum read and written once for several; their sums of squares."""
        return codec.decode_many(self.total, offset, count, block_size, chunks)

    def took_out(self, weight: float) -> None:
        """A chunk summed at `weight` left this sum again (refused, or moved on)."""
        self.taken_out = max(self.taken_out, weight)

    def move_encoded(
        self,
        dst: Accumulator,
        segment: Segment,
        codec: Codec,
        block_size: int,
        weight: float,
        norms: Sequence[float],
        limit: float,
    ) -> None:
        """A chunk added into this sum at `weight` moves to `dst` (an update's round was
        sealed while it streamed in): decoded once where the codec has a compiled path, bit
        for bit taking it out here and adding it there."""
        if self.compiled_moves and codec.move_into(
            self.total, dst.total, weight, segment, block_size
        ):
            return
        self.add_encoded(segment, codec, block_size, -weight, norms, limit)
        dst.add_encoded(segment, codec, block_size, weight, norms, limit)

    def release(self) -> None:
        """Free the sum once its round's step has read it: a merge's tail (the delta's
        write, the commit) holds no fragment-sized array beside the next round's."""
        self.total = np.zeros(0, np.float32)
        self.provisional = None

    def counted(self, weight: float, norms: Sequence[float], sign: int) -> None:
        """A whole update joins (sign 1) or leaves (-1) the round's totals."""
        self.weight += sign * weight

    def prepare(self) -> None:
        """Once before `outer_gradient`: whole-round quantities."""

    def outer_gradient(self, start: int, end: int, scale: float) -> np.ndarray:
        """The round's outer gradient over values [start, end), times `scale`."""
        out: np.ndarray = self.total[start:end] * np.float32(scale / self.weight)
        return out

    def gradient_factor(self, scale: float) -> float | None:
        """What `outer_gradient` multiplies `total` by, where that is all it does (a compiled
        outer step then computes it on the way); None where it does more."""
        return scale / self.weight


@dataclass
class RadialAccumulator(Accumulator):
    """Radial-directional averaging: per tensor, the weighted mean of the learners' norms
    along the direction of the weighted mean of their unit vectors. Learners' outer gradients
    are nearly orthogonal, so a plain mean shrinks them by about 1/sqrt(M); this keeps their
    typical length. Each update's per-tensor norms come with its first chunk."""

    norm_sum: np.ndarray = field(init=False)
    direction_norms: np.ndarray = field(init=False)
    compiled_moves: ClassVar[bool] = False  # each tensor's part is scaled by its own factor
    sums_together: ClassVar[bool] = False
    clips_values: ClassVar[bool] = False  # a unit vector per tensor: its norms are clipped

    def __post_init__(self) -> None:
        super().__post_init__()
        self.norm_sum = np.zeros(len(self.segments), np.float64)
        self.direction_norms = np.zeros(len(self.segments), np.float64)
        self._starts = np.cumsum((0, *self.segments))

    def _scaled(
        self, offset: int, values: np.ndarray, factor: float, norms: Sequence[float]
    ) -> None:
        end = offset + values.size
        first = int(np.searchsorted(self._starts, offset, side="right")) - 1
        t = first
        while t < len(self.segments) and self._starts[t] < end:
            lo, hi = max(offset, int(self._starts[t])), min(end, int(self._starts[t + 1]))
            norm = norms[t]
            f = np.float32(factor / norm) if norm > 0 else np.float32(0.0)
            view = values[lo - offset : hi - offset]
            np.multiply(view, f, out=view)
            t += 1
        part = self.total[offset:end]
        np.add(part, values, out=part)

    def add_encoded(
        self,
        segment: Segment,
        codec: Codec,
        block_size: int,
        weight: float,
        norms: Sequence[float],
        limit: float,
        max_squares: float = math.inf,
    ) -> float:
        """As the mean rule's, decoded whole first: each tensor's part is scaled by its own
        factor."""
        values, squares = codec.decode_checked(segment, block_size, weight, limit)
        check_squares(squares, max_squares)
        if weight >= 0:
            self.add(segment.offset, values, weight, norms)
        else:
            self.subtract(segment.offset, values, -weight, norms)
        return squares

    def add(self, offset: int, values: np.ndarray, weight: float, norms: Sequence[float]) -> None:
        self._scaled(offset, values, weight, norms)

    def subtract(
        self, offset: int, values: np.ndarray, weight: float, norms: Sequence[float]
    ) -> None:
        self._scaled(offset, values, -weight, norms)

    def counted(self, weight: float, norms: Sequence[float], sign: int) -> None:
        self.weight += sign * weight
        self.norm_sum += sign * weight * np.asarray(norms, np.float64)

    def prepare(self) -> None:
        for t in range(len(self.segments)):
            part = self.total[int(self._starts[t]) : int(self._starts[t + 1])]
            self.direction_norms[t] = float(np.linalg.norm(part.astype(np.float64)))

    def gradient_factor(self, scale: float) -> float | None:
        return None  # a factor per tensor

    def outer_gradient(self, start: int, end: int, scale: float) -> np.ndarray:
        out = np.zeros(end - start, np.float32)
        t = int(np.searchsorted(self._starts, start, side="right")) - 1
        while t < len(self.segments) and self._starts[t] < end:
            lo, hi = max(start, int(self._starts[t])), min(end, int(self._starts[t + 1]))
            length = self.direction_norms[t]
            if length > 0:
                factor = scale * (self.norm_sum[t] / self.weight) / length
                out[lo - start : hi - start] = self.total[lo:hi] * np.float32(factor)
            t += 1
        return out


@dataclass(frozen=True)
class MergeRule:
    """One way to combine a round's outer gradients (an entry of `MERGE_RULES`)."""

    name: str
    help: str
    accumulator: type[Accumulator]
    needs_norms: bool

    def new(self, size: int, segments: Sequence[int]) -> Accumulator:
        return self.accumulator(size, tuple(segments) or (size,))


MERGE_RULES: dict[str, MergeRule] = {
    rule.name: rule
    for rule in (
        MergeRule("mean", "the token-weighted mean of the outer gradients", Accumulator, False),
        MergeRule(
            "radial",
            "per tensor: the weighted mean of their norms along the direction of the weighted "
            "mean of their unit vectors",
            RadialAccumulator,
            True,
        ),
    )
}


@dataclass(frozen=True)
class OuterOptimizer:
    """Nesterov SGD on a flat fragment, in place, slice by slice (as optax's sgd with
    nesterov=True: trace <- g + m*trace; update <- g + m*trace; theta <- theta - lr*update).
    Its state is the momentum trace (none without momentum)."""

    lr: float
    momentum: float
    STATE_NAMES: ClassVar[tuple[str, ...]] = ("trace",)

    def init(self, theta: np.ndarray) -> list[np.ndarray]:
        return [np.zeros_like(theta, np.float32)] if self.momentum else []

    def trace(self, state: list[np.ndarray], s: slice) -> np.ndarray | None:
        """The momentum trace over values `s` (a view), None without momentum."""
        return state[0][s] if self.momentum else None

    def move(self, state: list[np.ndarray], outer_gradient: np.ndarray, s: slice) -> np.ndarray:
        """The step -lr*update over values `s` (outer_gradient is that slice, scratch);
        updates the state's slice in place."""
        g = outer_gradient
        if self.momentum:
            trace = state[0][s]
            np.multiply(trace, np.float32(self.momentum), out=trace)
            np.add(trace, g, out=trace)
            g += np.float32(self.momentum) * trace
        np.multiply(g, np.float32(-self.lr), out=g)
        return g
