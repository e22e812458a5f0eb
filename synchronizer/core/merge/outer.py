"""The outer optimizer: Nesterov SGD on a flat fragment, in place, slice by slice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np


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
