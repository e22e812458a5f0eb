from __future__ import annotations

import pytest

from cluster.view import _fmt


@pytest.mark.parametrize("missing", [None, "", "-1.0", "nan"])
def test_a_value_not_measured_yet_shows_as_a_dash(missing: str | None) -> None:
    """Before a learner's first eval the live view says `-`, not `nan`."""
    assert _fmt(missing) == "-"


def test_a_measured_value_shows_its_digits() -> None:
    assert _fmt("2.5") == "2.500"
    assert _fmt("1234.5", digits=0) == "1234"
    assert _fmt("running") == "running"
