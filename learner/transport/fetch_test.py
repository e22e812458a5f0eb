"""What a range fetch checks, without a network."""

from __future__ import annotations

from learner.transport.fetch import joined


def test_ranges_are_the_same_values_however_they_are_cut() -> None:
    assert joined([(0, 4), (4, 2), (10, 1), (11, 3)]) == [(0, 6), (10, 4)]
    assert joined([(0, 4), (5, 2)]) == [(0, 4), (5, 2)]
    assert joined([]) == []
