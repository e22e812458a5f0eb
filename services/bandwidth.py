"""What data-parallel training would send, the yardstick for atoll's bytes on the wire."""

from __future__ import annotations


def dp_equivalent_bytes(parameters: int, learners: int, learner_steps: int) -> float:
    """Bytes a ring all-reduce of fp32 gradients sends for the same work.

    Per learner and step, each of M members sends 2*(M-1)/M * 4 * N bytes; summed over every
    learner-step that was done (`learner_steps`, all learners together).
    """
    if learners < 2:
        return 0.0
    return 2.0 * (learners - 1) / learners * 4.0 * parameters * learner_steps
