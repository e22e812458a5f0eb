"""What each update weighs in its round, and how much of a full outer step a round takes."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import numpy as np


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


def live_round_scale(
    members: AbstractSet[str],
    live: AbstractSet[str] | None,
    dropped: AbstractSet[str] = frozenset(),
) -> float:
    """A round's step as a share of a full one: its member slots over the live learners it
    stands for (`partial_round_scale`), its members counted among them (each was live when
    admitted; one that left since still takes only its share). None: full rounds. Never a
    full step for a member beside live learners outside the round. A `dropped` member (its
    update merged at no weight) contributes nothing, as a live learner that sent nothing:
    counting it would scale the others' mean up to its share, so that a hostile slot whose
    every update is dropped would double the step of an honest update it joins alone."""
    if live is None:
        return 1.0
    return partial_round_scale(len(members - dropped), len(live | members))


def tensor_norms(values: np.ndarray, segments: Sequence[int]) -> list[float]:
    """The L2 norm of each tensor (a run of `segments` sizes) of a flat fragment."""
    out, start = [], 0
    for size in segments or [values.size]:
        out.append(float(np.linalg.norm(values[start : start + size].astype(np.float64))))
        start += size
    return out
