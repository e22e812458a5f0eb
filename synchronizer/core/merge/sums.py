"""A merge rule's declared contract, and the streaming-sum mechanics every rule shares.

An owner sums each update into its round's running sum chunk by chunk as the chunks
arrive, takes a refused update out again, moves chunks to the next round when a round is
sealed under them, and at the merge asks the sum for the round's outer gradient. What it
asks is `RoundSum`; what it reads of the rule that made the sum is `MergeRule`.
`StreamingSum` does all of it for a rule that says how a chunk's values enter the sum
(`scale_into`) and how the sum becomes an outer gradient (`outer_gradient`,
`gradient_factor`). A rule registers itself by name (`register`) in `REGISTRY`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, Protocol, TypeVar

import numpy as np

from services.blockwise import check_squares
from services.codec import Codec, Ready, Segment


class RoundSum(Protocol):
    """One round's running sum of one fragment, as its owner drives it."""

    total: np.ndarray  # the sum, one float32 per value of the fragment
    weight: float  # the weights of the whole updates counted in
    # The round's provisional updates summed apart at the weights they claimed, until the
    # round is sealed and their weights are known; None while it has none.
    provisional: RoundSum | None
    # The largest weight taken out of this sum again (a refused or moved update): where
    # weights are unbounded, what is left may have lost the others' float32 bits.
    taken_out: float

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
        """Decode one chunk and add it weighing `weight` (negative: take it out again);
        its unweighted sum of squares. CodecError or OverSquares, the sum untouched."""
        ...

    def ready_encoded(
        self,
        segment: Segment,
        codec: Codec,
        block_size: int,
        weight: float,
        limit: float,
        max_squares: float = math.inf,
    ) -> Ready | None:
        """`add_encoded`'s checks of one chunk, nothing added, for `add_many`; None where it
        goes alone through `add_encoded`."""
        ...

    def add_many(
        self, offset: int, count: int, codec: Codec, block_size: int, chunks: list[Ready]
    ) -> list[float]:
        """`add_encoded` of each ready chunk of one range in turn, bit for bit."""
        ...

    def took_out(self, weight: float) -> None:
        """A chunk summed at `weight` left this sum again."""
        ...

    def move_encoded(
        self,
        dst: RoundSum,
        segment: Segment,
        codec: Codec,
        block_size: int,
        weight: float,
        norms: Sequence[float],
        limit: float,
    ) -> None:
        """A chunk added here at `weight` moves to `dst`, bit for bit."""
        ...

    def counted(self, weight: float, norms: Sequence[float], sign: int) -> None:
        """A whole update joins (sign 1) or leaves (-1) the round's totals."""
        ...

    def prepare(self) -> None:
        """Once before `outer_gradient`: whole-round quantities."""
        ...

    def outer_gradient(self, start: int, end: int, scale: float) -> np.ndarray:
        """The round's outer gradient over values [start, end), times `scale`."""
        ...

    def gradient_factor(self, scale: float) -> float | None:
        """What `outer_gradient` multiplies `total` by, where that is all it does; None
        where it does more."""
        ...

    def release(self) -> None:
        """Free the sum once its round's step has read it."""
        ...


class MergeRule(Protocol):
    """One way to combine a round's outer gradients, as the owner, the admission and the
    settings read it."""

    @property
    def name(self) -> str: ...  # the `merge` setting's value
    @property
    def help(self) -> str: ...  # what it does, in a sentence
    @property
    def needs_norms(self) -> bool:
        """Whether each update's per-tensor norms come with its first chunk."""
        ...

    @property
    def clips_values(self) -> bool:
        """Whether an update is clipped by scaling its values in the sum; else by scaling the
        norms it is counted with, its direction kept."""
        ...

    @property
    def sums_in_parts(self) -> bool:
        """Whether an update may come in parts, one per process of a learner that spans
        several hosts, each summed as it arrives."""
        ...

    def new(self, size: int, segments: Sequence[int]) -> RoundSum:
        """An empty round's sum of a fragment of `size` values, tensors of `segments`."""
        ...


class StreamingSum:
    """The running sum of one round of one fragment: the mechanics every rule shares. A rule
    subclasses it, names itself, and says how a chunk's decoded values enter the sum and how
    the sum becomes the round's outer gradient."""

    name: ClassVar[str]
    help: ClassVar[str]
    needs_norms: ClassVar[bool] = False
    clips_values: ClassVar[bool] = True
    sums_in_parts: ClassVar[bool] = True
    # Whether every value of a chunk is scaled by one factor: the codec's compiled passes
    # then add a chunk, move it to another sum, and sum chunks of one range several at once;
    # else each chunk is decoded whole first and its values go in through `scale_into`.
    compiled: ClassVar[bool] = True

    def __init__(self, size: int, segments: tuple[int, ...]) -> None:
        self.size, self.segments = size, segments  # tensor sizes, in layout order
        self.total = np.zeros(size, np.float32)
        self.weight = 0.0
        self.provisional: RoundSum | None = None
        self.taken_out = 0.0

    @classmethod
    def new(cls, size: int, segments: Sequence[int]) -> StreamingSum:
        return cls(size, tuple(segments) or (size,))

    def scale_into(
        self, offset: int, values: np.ndarray, factor: float, norms: Sequence[float]
    ) -> None:
        """Add decoded `values` (scratch) from `offset` times `factor` (negative: out)."""
        np.multiply(values, np.float32(factor), out=values)
        part = self.total[offset : offset + values.size]
        np.add(part, values, out=part)

    def add(self, offset: int, values: np.ndarray, weight: float, norms: Sequence[float]) -> None:
        """Add one decoded chunk of an update weighing `weight` (values are scratch)."""
        self.scale_into(offset, values, weight, norms)

    def subtract(
        self, offset: int, values: np.ndarray, weight: float, norms: Sequence[float]
    ) -> None:
        """Take one chunk added earlier out again (an update refused after summing)."""
        self.scale_into(offset, values, -weight, norms)

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
        one pass per cache-sized piece where `compiled`; returns its unweighted sum of
        squares. Raises CodecError, the sum untouched, for a bad payload or values that
        times the weight could pass `limit`; OverSquares, the sum untouched, for values
        whose sum of squares passes `max_squares`."""
        if self.compiled:
            return codec.decode_into(self.total, weight, segment, block_size, limit, max_squares)
        values, squares = codec.decode_checked(segment, block_size, weight, limit)
        check_squares(squares, max_squares)
        self.scale_into(segment.offset, values, weight, norms)
        return squares

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
        alone through `add_encoded` (not `compiled`, or Codec.ready says so)."""
        if not self.compiled:
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
        dst: RoundSum,
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
        if self.compiled and codec.move_into(self.total, dst.total, weight, segment, block_size):
            return
        self.add_encoded(segment, codec, block_size, -weight, norms, limit)
        dst.add_encoded(segment, codec, block_size, weight, norms, limit)

    def counted(self, weight: float, norms: Sequence[float], sign: int) -> None:
        """A whole update joins (sign 1) or leaves (-1) the round's totals."""
        self.weight += sign * weight

    def prepare(self) -> None:
        """Once before `outer_gradient`: whole-round quantities."""

    def outer_gradient(self, start: int, end: int, scale: float) -> np.ndarray:
        """The round's outer gradient over values [start, end), times `scale`: the sum
        times `gradient_factor`, unless a rule computes more."""
        factor = self.gradient_factor(scale)
        assert factor is not None, f"the {self.name} rule computes its own outer gradient"
        out: np.ndarray = self.total[start:end] * np.float32(factor)
        return out

    def gradient_factor(self, scale: float) -> float | None:
        """What `outer_gradient` multiplies `total` by, where that is all it does (a compiled
        outer step then computes it on the way); None where it does more. A round whose
        every member merged at no weight (dropped) steps by nothing."""
        return scale / self.weight if self.weight > 0 else 0.0

    def release(self) -> None:
        """Free the sum once its round's step has read it: a merge's tail (the delta's
        write, the commit) holds no fragment-sized array beside the next round's."""
        self.total = np.zeros(0, np.float32)
        self.provisional = None


REGISTRY: dict[str, MergeRule] = {}
Rule = TypeVar("Rule", bound=type[StreamingSum])


def register(rule: Rule) -> Rule:
    """Add a rule to REGISTRY under its name (a class decorator)."""
    if rule.name in REGISTRY:
        raise ValueError(f"a merge rule named {rule.name!r} is registered already")
    REGISTRY[rule.name] = rule
    return rule
