"""A hostile learner: what an authorized slot could send in place of its honest outer
gradient. For `atoll bench byzantine` and the tests of the synchronizer's defences, never a
real job: a learner started with `--hostile KIND` trains as usual and corrupts each update it
sends, every round it can.

The kinds (docs/security.md says what each defence bounds):
- `sign-flip`: the honest update negated (same norm, the opposite way);
- `x100`: the honest update times 100;
- `random`: noise of the honest update's norm (a useless update no norm bound tells apart);
- `replace`: 0.99 times the fragment's global value it started from, an update that merged
  alone at a full step would leave the fragment at a hundredth of itself.
"""

from __future__ import annotations

from typing import Literal, cast, get_args

import numpy as np

Hostility = Literal["sign-flip", "x100", "random", "replace"]
HOSTILITIES = cast(tuple[Hostility, ...], get_args(Hostility))


def corrupt(
    kind: Hostility, delta: np.ndarray, anchor: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """The update a learner of `kind` sends in place of `delta` (its honest outer gradient,
    anchor minus its trained values), for a fragment whose global value was `anchor`."""
    if kind == "sign-flip":
        out = -delta
    elif kind == "x100":
        out = delta * np.float32(100.0)
    elif kind == "random":
        noise = rng.standard_normal(delta.shape, dtype=np.float32)
        norm = float(np.linalg.norm(noise))
        out = noise * np.float32(float(np.linalg.norm(delta)) / norm) if norm > 0 else noise
    elif kind == "replace":
        out = anchor * np.float32(0.99)
    else:  # pragma: no cover - Literal's choices are checked where the flag is read
        raise ValueError(f"unknown hostility {kind!r}; choose one of {', '.join(HOSTILITIES)}")
    return np.asarray(out, dtype=np.float32)
