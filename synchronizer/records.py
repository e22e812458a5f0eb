"""What a fragment's owner keeps of the updates streaming into its rounds, and how it says
no: an update on its way in (`Update`) and each of its chunks summed so far (`Chunk`), a
version's keyframe in the tensor store (`Keyframe`), and the owner's exceptions.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import xxhash

from services import codec as codecs
from synchronizer.core.merge import RoundSum


class RoundBusy(ValueError):
    """The learner already has an update in the open round; it may resend later."""


class NormTooLarge(ValueError):
    """An update's norm is out of bounds against the fragment's recent updates; `norm`: the
    norm its values reached before they were refused (None: not measured)."""

    def __init__(self, message: str, norm: float | None = None) -> None:
        super().__init__(message)
        self.norm = norm


class OwnerLost(RuntimeError):
    """This replica no longer owns the fragment (its lease lapsed or was taken)."""


@dataclass(eq=False)
class Chunk:
    """A chunk summed into a round's accumulator (None: not summed yet, its update's weight
    is provisional), kept until its update is received (provisional: until its round merges)."""

    segment: codecs.Segment
    accumulator: RoundSum | None


@dataclass(eq=False)
class Update:
    """An update on its way in: what it weighs, where it is summed, its chunks so far."""

    learner: str
    incarnation: str
    seq: int
    base_version: int
    c_steps: int
    c_tokens: int
    compute_seconds: float
    weight: float
    norms: tuple[float, ...]
    codec: codecs.Codec
    block_size: int
    accumulator: RoundSum
    chunks: list[Chunk] = field(default_factory=list)
    hasher: Any = field(default_factory=xxhash.xxh3_64)
    norm_bound: float = math.inf
    squares: float = 0.0  # sum of squares of the decoded values so far
    # No other learner's update to cap the weight against when it began: it is summed only
    # once its round is sealed, capped against the round's other members then.
    provisional: bool = False
    arrived: int = 0  # values whose chunks have come (queued to be summed, or summed)
    # When its first chunk came, and that chunk's values: its pace is from the chunks after.
    first_at: float = 0.0
    first_values: int = 0
    abandoned: bool = False  # will not be received: chunk sums still queued add nothing
    staleness: float = 1.0  # what its weight was multiplied by for being behind (`begin`)
    # What its norm was scaled by to merge within its fragment's clip bound (`Guards.clip_bound`):
    # 1 unclipped. Set once whole, before it is recorded.
    clip: float = 1.0
    # How its values' signs agree with the fragment's last merged outer gradient
    # (`RoundSums.agreement`, from -1 to 1); None where not checked. Below
    # --min-update-agreement it merges at no weight: its clip is then 0.
    agreement: float | None = None
    # How its values' signs agree with the fragment's own values' (the same sampled pass):
    # 1 where every value moves the fragment toward zero (an update that shrinks it, as one
    # replacing it with a small vector does), -1 where every value grows it. None where not
    # checked. Over --max-shrink-agreement it merges at no weight.
    shrink: float | None = None
    # Its move to the next round when its round was sealed while it arrived: the move may
    # settle a provisional weight, so whoever reads the weight on the event loop waits.
    moved: Future[None] | None = None

    @property
    def norm(self) -> float:
        return math.sqrt(self.squares)

    @property
    def uid(self) -> str:
        return f"{self.learner}/{self.incarnation}/{self.seq}"


@dataclass(frozen=True)
class Keyframe:
    """A version's value, optimizer state and residual, written whole (values.py)."""

    version: int
    value: str
    state: tuple[str, ...]
