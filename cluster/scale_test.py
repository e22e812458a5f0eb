from __future__ import annotations

import pytest

from cluster.chaos import ChaosError
from cluster.scale import ScaleEvent, parse_scale, slots_ever


def test_parse_scale_reads_events_in_time_order() -> None:
    events = parse_scale("at=2m,learners=3; at=60s,learners=6")
    assert events == [ScaleEvent(60.0, 6), ScaleEvent(120.0, 3)]


def test_parse_scale_reads_a_readiness_hold() -> None:
    events = parse_scale("at=1s,learners=4;at=30s,learners=2,ready=20")
    assert events == [ScaleEvent(1.0, 4), ScaleEvent(30.0, 2, ready_steps=20)]


@pytest.mark.parametrize(
    "spec", ["at=60s", "learners=3", "at=1s,learners=0", "at=1s,n=2", "at=1s,learners=2,ready=x"]
)
def test_parse_scale_says_what_to_write(spec: str) -> None:
    with pytest.raises(ChaosError, match="--scale"):
        parse_scale(spec)


def test_slots_ever_counts_slots_numbered_on() -> None:
    events = parse_scale("at=10s,learners=6;at=20s,learners=3;at=30s,learners=5")
    assert slots_ever(3, events) == 8  # learner-0..2, 3..5, then 6..7
