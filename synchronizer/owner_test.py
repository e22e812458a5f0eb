from __future__ import annotations

import math

from synchronizer.owner import MAX_STEP_SPAN, step_scale


def test_an_update_of_more_steps_may_be_larger_and_one_of_fewer_is_held_to_the_noise_floor() -> (
    None
):
    assert step_scale(10, 10) == 1.0
    # A reply came late: 30 steps at once after 5 (what an honest learner under load sent,
    # and the bound refused before steps counted).
    assert step_scale(30, 5) == 6.0
    # The update after it: 1 step after 2H - 1; its norm shrinks at most as noise does.
    assert math.isclose(step_scale(1, 199), math.sqrt(1 / 199))
    # A claimed step count widens the bound only so far.
    assert step_scale(10**9, 10) == MAX_STEP_SPAN
    assert step_scale(0, 0) == 1.0
