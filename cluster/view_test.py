from __future__ import annotations

from pathlib import Path

import pytest

from cluster.view import ClusterState, LiveView, _fmt, slot_status


@pytest.mark.parametrize("missing", [None, "", "-1.0", "nan"])
def test_a_value_not_measured_yet_shows_as_a_dash(missing: str | None) -> None:
    """Before a learner's first eval the live view says `-`, not `nan`."""
    assert _fmt(missing) == "-"


def test_a_measured_value_shows_its_digits() -> None:
    assert _fmt("2.5") == "2.500"
    assert _fmt("1234.5", digits=0) == "1234"
    assert _fmt("running") == "running"


@pytest.mark.parametrize(
    ("fields", "lease_live", "running", "status"),
    [
        (None, False, True, "starting"),  # launched, no hello yet (importing, compiling)
        ({"step": "0"}, True, True, "starting"),  # joined, no step yet
        ({"step": "12"}, False, True, "starting"),  # its lease lapsed while it compiles
        ({"step": "12"}, True, True, "running"),
        ({"step": "12"}, True, False, "down"),  # killed: its lease has not run out yet
        (None, False, False, "down"),
        ({"step": "40", "done": "1"}, False, False, "done"),
    ],
)
def test_a_slot_is_starting_running_down_or_done(
    fields: dict[str, str] | None, lease_live: bool, running: bool, status: str
) -> None:
    assert slot_status(fields, lease_live, running) == status


def test_the_global_eval_is_the_newest_one_whoever_ran_it(tmp_path: Path) -> None:
    view = LiveView(False, tmp_path)
    view.hear(ClusterState(0, {"learner-0": {"eval_loss": "-1.0"}, "learner-1": {}}))
    assert view.global_eval is None
    view.hear(ClusterState(1, {"learner-0": {"eval_loss": "3.1"}, "learner-1": {}}))
    view.hear(
        ClusterState(2, {"learner-0": {"eval_loss": "3.1"}, "learner-1": {"eval_loss": "2.7"}})
    )
    view.hear(
        ClusterState(3, {"learner-0": {"eval_loss": "3.1"}, "learner-1": {"eval_loss": "2.7"}})
    )
    assert view.global_eval == 2.7  # learner-0's 3.1 is older: an older global model
    view.hear(
        ClusterState(4, {"learner-0": {"eval_loss": "2.9"}, "learner-1": {"eval_loss": "2.7"}})
    )
    assert view.global_eval == 2.9  # newer, though higher: this is what the model scores now
    view.hear(ClusterState(5, {}))  # they left: the last frame still has their rows
    assert set(view._fields) == {"learner-0", "learner-1"}
