from __future__ import annotations

import math
from pathlib import Path

from cluster.plot import CHANCE, EVAL_LABEL, plot_losses


def test_the_plot_marks_chance_restarts_and_merges_and_says_what_the_dots_are(
    tmp_path: Path,
) -> None:
    summaries = [
        {
            "learner": "learner-0",
            "started_at": 100.0,
            "losses": [(1.0, 1, 512, 5.4), (5.0, 20, 10240, 3.0)],
            "evals": [(4.0, 10, 5120, 3.5), (6.0, 30, 15360, 2.9)],
        }
    ]
    path = tmp_path / "loss.png"
    labels = plot_losses(summaries, path, restarts=[103.0], merges=[102.0, 104.5, 105.0])
    assert path.stat().st_size > 10_000
    assert math.log(256) == CHANCE
    assert {
        "learner-0",
        EVAL_LABEL,
        "chance (uniform over 256 bytes)",
        "learner restarted",
        "merge committed",
    } <= set(labels)
    assert "held-out" in EVAL_LABEL
    # Without restarts or merges, no mark claims any.
    labels = plot_losses(summaries, path)
    assert "learner restarted" not in labels
    assert "merge committed" not in labels
