"""How a round combines outer gradients, summed as they arrive, and the outer step.

Pure numpy over float32 arrays; no JAX (the synchronizer never touches an accelerator).
A merge rule is one file in `rules/`: a small class over the shared streaming-sum mechanics
(`StreamingSum`) that keeps the declared contract (`MergeRule`, `RoundSum`) and registers
itself by name in `REGISTRY`, from which every list of the rules' names follows.
"""

from synchronizer.core.merge import rules as _rules  # noqa: F401  (each rule registers itself)
from synchronizer.core.merge.outer import OuterOptimizer
from synchronizer.core.merge.sums import REGISTRY, MergeRule, RoundSum, StreamingSum, register
from synchronizer.core.merge.weights import (
    capped_weights,
    live_round_scale,
    partial_round_scale,
    staleness_weight,
    tensor_norms,
    token_weight,
)

__all__ = [
    "REGISTRY",
    "MergeRule",
    "OuterOptimizer",
    "RoundSum",
    "StreamingSum",
    "capped_weights",
    "live_round_scale",
    "partial_round_scale",
    "register",
    "staleness_weight",
    "tensor_norms",
    "token_weight",
]
