"""Radial-directional averaging: per tensor, the weighted mean of the learners' norms along
the direction of the weighted mean of their unit vectors. Learners' outer gradients are
nearly orthogonal, so a plain mean shrinks them by about 1/sqrt(M); this keeps their
typical length. Each update's per-tensor norms come with its first chunk, so an update in
parts (whose processes each hold some values) cannot be summed this way."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from synchronizer.core.merge.sums import StreamingSum, register


@register
class Radial(StreamingSum):
    name = "radial"
    help = (
        "per tensor: the weighted mean of their norms along the direction of the weighted "
        "mean of their unit vectors"
    )
    needs_norms = True
    clips_values = False  # a unit vector per tensor: its norms are clipped
    sums_in_parts = False
    compiled = False  # each tensor's part is scaled by its own factor

    def __init__(self, size: int, segments: tuple[int, ...]) -> None:
        super().__init__(size, segments)
        self.norm_sum = np.zeros(len(segments), np.float64)
        self.direction_norms = np.zeros(len(segments), np.float64)
        self._starts = np.cumsum((0, *segments))

    def _tensors(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """The tensors values [start, end) cross: (tensor, lo, hi) of each, lo..hi its part."""
        out, t = [], int(np.searchsorted(self._starts, start, side="right")) - 1
        while t < len(self.segments) and self._starts[t] < end:
            out.append((t, max(start, int(self._starts[t])), min(end, int(self._starts[t + 1]))))
            t += 1
        return out

    def scale_into(
        self, offset: int, values: np.ndarray, factor: float, norms: Sequence[float]
    ) -> None:
        """Each tensor's part divided by the update's norm of that tensor: a unit vector,
        times `factor`."""
        for t, lo, hi in self._tensors(offset, offset + values.size):
            f = np.float32(factor / norms[t]) if norms[t] > 0 else np.float32(0.0)
            view = values[lo - offset : hi - offset]
            np.multiply(view, f, out=view)
        part = self.total[offset : offset + values.size]
        np.add(part, values, out=part)

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
        for t, lo, hi in self._tensors(start, end):
            length = self.direction_norms[t]
            if length > 0 and self.weight > 0:  # weight 0: every member merged at no weight
                factor = scale * (self.norm_sum[t] / self.weight) / length
                out[lo - start : hi - start] = self.total[lo:hi] * np.float32(factor)
        return out
