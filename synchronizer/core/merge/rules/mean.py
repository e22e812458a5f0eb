"""The mean rule: the token-weighted mean of the round's outer gradients."""

from __future__ import annotations

from synchronizer.core.merge.sums import StreamingSum, register


@register
class Mean(StreamingSum):
    """Sum of w * delta over the round, divided by the sum of w: what the shared mechanics
    do as they stand."""

    name = "mean"
    help = "the token-weighted mean of the outer gradients"
