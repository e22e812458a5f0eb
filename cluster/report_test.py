from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster.report import (
    check_invariants,
    combine_incarnations,
    dropped_with_sender,
    read_summaries,
)


def _summary(
    started_at: float, steps: int, losses: list[list[float]], **extra: Any
) -> dict[str, Any]:
    return {
        "learner": "learner-0",
        "started_at": started_at,
        "steps": steps,
        "loss": {"initial": losses[0][3] if losses else None, "final": losses[-1][3]},
        "losses": losses,
        "evals": [],
        **extra,
    }


def test_a_slot_summary_covers_every_incarnation_on_one_clock() -> None:
    killed = _summary(100.0, 20, [[1.0, 1, 8, 5.3], [9.0, 20, 160, 3.0]], partial=True)
    restarted = _summary(115.0, 40, [[2.0, 21, 168, 2.6], [8.0, 40, 320, 2.3]])
    s = combine_incarnations([killed, restarted])
    assert s["loss"] == {"initial": 5.3, "final": 2.3}  # the job started at 5.3
    assert [p[0] for p in s["losses"]] == [1.0, 9.0, 17.0, 23.0]  # time does not restart
    assert (s["steps"], s["incarnations"], s.get("partial")) == (40, 2, None)


def test_read_summaries_orders_incarnations_by_launch(tmp_path: Path) -> None:
    for n, steps in ((2, 40), (1, 20), (10, 90)):
        losses = [[0.0, steps, 0, float(n)]]
        (tmp_path / f"learner-0.{n}.summary.json").write_text(
            json.dumps(_summary(float(n), steps, losses))
        )
    (summary,) = read_summaries(tmp_path)
    assert summary["steps"] == 90
    assert summary["loss"]["initial"] == 1.0


def test_updates_dropped_with_their_round_and_their_sender_are_not_lost() -> None:
    log = [[{"version": 1, "uids": ["l0/a/1"]}]]
    assert not check_invariants(log, [1], accepted=3, pending=0).ok
    # l1's incarnation b died before re-sending what its dead round held; l2's c finished,
    # so its dropped update is a loss all the same.
    dropped = dropped_with_sender(["l1/b/1", "l2/c/4"], finished={"a", "c"})
    assert dropped == ["l1/b/1"]
    inv = check_invariants(log, [1], accepted=3, pending=0, dropped=len(dropped))
    assert (inv.ok, inv.lost_updates, inv.dropped_with_sender) == (False, 1, 1)
    inv = check_invariants(log, [1], accepted=2, pending=0, dropped=1)
    assert inv.ok, inv.problems
