import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from synchronizer.core.admission import step_scale
from synchronizer.core.recent import Recent, kth_smallest

VALUES = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False)
ENTRIES = st.lists(
    st.tuples(st.sampled_from([f"l{i}" for i in range(40)]), VALUES, st.integers(1, 6)),
    max_size=120,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ENTRIES, st.sampled_from(["l0", "l1", "nobody"]), st.integers(1, 12))
def test_the_median_of_others_is_the_one_a_sort_of_their_scaled_values_gives(
    entries: list[tuple[str, float, int]], asking: str, steps: int
) -> None:
    recent, last = Recent(), {}
    for learner, value, key in entries:  # later values replace a learner's earlier ones
        recent.set(learner, value, key)
        last[learner] = (value, key)
    scaled = [v * step_scale(steps, k) for who, (v, k) in last.items() if who != asking]
    got = recent.median_of_others(asking, lambda k: step_scale(steps, k))
    assert got == (statistics.median(scaled) if scaled else None)
    # Asking changes nothing.
    assert dict(recent.items()) == last
    unscaled = [v for who, (v, _) in last.items() if who != asking]
    assert recent.median_of_others(asking) == (statistics.median(unscaled) if unscaled else None)


def test_kth_smallest_over_runs_with_ties_and_bad_k() -> None:
    runs = [(1.0, [1.0, 2.0, 2.0, 5.0]), (2.0, [1.0, 1.0, 3.0])]  # scaled: 2, 2, 6
    assert [kth_smallest(runs, k) for k in range(7)] == [1.0, 2.0, 2.0, 2.0, 2.0, 5.0, 6.0]
    with pytest.raises(IndexError):
        kth_smallest(runs, 7)


def test_a_value_that_is_not_finite_is_refused_and_changes_nothing() -> None:
    recent = Recent({"a": 1.0, "b": 3.0})
    with pytest.raises(ValueError, match="not finite"):
        recent.set("a", float("nan"))
    assert recent.get("a") == 1.0
    assert recent.median_of_others("c") == 2.0
    assert recent.median_of_others("a") == 3.0
    assert Recent().median_of_others("a") is None
