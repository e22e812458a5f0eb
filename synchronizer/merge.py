"""The merge of one round and the outer step: pure functions over numpy arrays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclass(frozen=True)
class Contribution:
    """One learner's outer gradient for a fragment, as the merge sees it."""

    uid: str
    learner: str
    delta: np.ndarray
    c_steps: int
    c_tokens: int
    base_version: int
    compute_seconds: float


def token_weight(c_tokens: int, c_steps: int) -> float:
    """w = c_tokens^2 / c_steps: quantity (tokens) times quality (tokens per step)."""
    if c_steps <= 0 or c_tokens <= 0:
        return 0.0
    return float(c_tokens) ** 2 / float(c_steps)


def weighted_mean(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    total = float(sum(weights))
    if not deltas or total <= 0.0:
        raise ValueError("a merge needs at least one contribution with positive weight")
    out = np.zeros_like(deltas[0], dtype=np.float64)
    for delta, weight in zip(deltas, weights, strict=True):
        out += (weight / total) * delta
    return out.astype(np.float32)


def radial_directional_mean(
    deltas: Sequence[np.ndarray], weights: Sequence[float], segments: Sequence[int]
) -> np.ndarray:
    """Per tensor (a segment of the fragment): the weighted mean of the learners' norms times
    the direction of the weighted mean of their unit vectors. Learners' outer gradients are
    nearly orthogonal, so a plain mean shrinks them by about 1/sqrt(M); this keeps their
    typical length and averages only their directions."""
    total = float(sum(weights))
    if not deltas or total <= 0.0:
        raise ValueError("a merge needs at least one contribution with positive weight")
    out = np.zeros_like(deltas[0], dtype=np.float32)
    start = 0
    for size in segments or [deltas[0].size]:
        end = start + size
        norm = 0.0
        direction = np.zeros(size, np.float64)
        for delta, weight in zip(deltas, weights, strict=True):
            part = delta[start:end].astype(np.float64)
            length = float(np.linalg.norm(part))
            norm += weight / total * length
            if length > 0.0:
                direction += weight / total * part / length
        length = float(np.linalg.norm(direction))
        if length > 0.0:
            out[start:end] = (norm * direction / length).astype(np.float32)
        start = end
    return out


def staleness_weight(staleness: int, decay: float) -> float:
    """decay^staleness: an update `staleness` versions behind counts that much less."""
    return float(decay) ** max(0, staleness)


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


def merge_contributions(
    contributions: Sequence[Contribution],
    live_learners: int = 0,
    *,
    method: str = "mean",
    segments: Sequence[int] = (),
    version: int | None = None,
    staleness_decay: float = 1.0,
) -> tuple[np.ndarray, list[float], float]:
    """The token-weighted outer gradient (`mean`, or `radial`: radial-directional per
    tensor of `segments`), each contribution's weight (times decay^staleness against
    `version`), and the partial round scale applied (1.0 when `live_learners` is 0)."""
    weights = [token_weight(c.c_tokens, c.c_steps) for c in contributions]
    if sum(weights) <= 0.0:  # every learner reported zero tokens: fall back to a plain mean
        weights = [1.0] * len(contributions)
    if version is not None and staleness_decay != 1.0:
        weights = [
            w * staleness_weight(version - c.base_version, staleness_decay)
            for w, c in zip(weights, contributions, strict=True)
        ]
    deltas = [c.delta for c in contributions]
    if method == "radial":
        mean = radial_directional_mean(deltas, weights, segments)
    else:
        mean = weighted_mean(deltas, weights)
    learners = len({c.learner for c in contributions})
    scale = partial_round_scale(learners, live_learners) if live_learners else 1.0
    return (mean * np.float32(scale) if scale != 1.0 else mean), weights, scale


@dataclass(frozen=True)
class OuterOptimizer:
    """Nesterov SGD on a flat fragment; its state travels as a list of float32 arrays."""

    lr: float
    momentum: float

    @property
    def _tx(self) -> optax.GradientTransformation:
        return optax.sgd(learning_rate=self.lr, momentum=self.momentum, nesterov=True)

    def init(self, theta: np.ndarray) -> list[np.ndarray]:
        leaves = jax.tree.leaves(self._tx.init(jnp.asarray(theta)))
        return [np.asarray(leaf, np.float32) for leaf in leaves]

    def step(
        self, theta: np.ndarray, state: list[np.ndarray], outer_gradient: np.ndarray
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Theta <- OuterOpt(Theta, Delta): Delta plays the gradient (base - theta)."""
        new_theta, new_leaves = _compiled_step(self.lr, self.momentum)(
            jnp.asarray(theta), [jnp.asarray(s) for s in state], jnp.asarray(outer_gradient)
        )
        return np.asarray(new_theta, np.float32), [np.asarray(s, np.float32) for s in new_leaves]


@lru_cache(maxsize=8)
def _compiled_step(lr: float, momentum: float) -> Any:
    tx = optax.sgd(learning_rate=lr, momentum=momentum, nesterov=True)

    @jax.jit
    def step(theta: jax.Array, leaves: list[jax.Array], grad: jax.Array) -> Any:
        treedef = jax.tree.structure(tx.init(theta))
        state = jax.tree.unflatten(treedef, leaves)
        updates, state = tx.update(grad, state, theta)
        return optax.apply_updates(theta, updates), jax.tree.leaves(state)

    return step
