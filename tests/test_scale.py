"""`atoll up --scale`: a running job grows and shrinks, as an operator scales a learner pool."""

from __future__ import annotations

from pathlib import Path

from services.goodput import slot_ends, slot_starts
from tests.test_up import up


def test_a_job_grows_then_shrinks_and_its_newcomers_are_merged(tmp_path: Path) -> None:
    report = up(
        tmp_path,
        "--learners",
        "2",
        "--steps",
        "2000",
        "--no-shared-budget",  # the two who stay train on well past the leavers' exit
        "--inner-steps",
        "10",
        "--fragments",
        "2",
        "--quorum",
        "3",
        "--scale",
        # A newcomer takes 20-40 s to start on two loaded cores: the shrink waits until
        # every slot has done two inner loops, so each newcomer has sent updates.
        "at=1s,learners=4;at=20s,learners=2,ready=20",
        "--speeds",  # the first two at half speed leave CPU for the newcomers to start
        "[0.5, 0.5]",
    )
    tape = report.pop("_tape")
    assert report["invariants"]["ok"], report["invariants"]
    assert report["faults"]["injected"] == 0
    # The newcomers joined the running job, and their updates entered merges.
    merged = {p["learner"]: p["merged_by_incarnation"] for p in report["per_learner"]}
    for newcomer in ("learner-2", "learner-3"):
        assert sum(merged[newcomer].values()) > 0, merged
    # The newest slots left cleanly: each wrote its final summary, none counted as dead.
    ends = slot_ends(tape)
    assert set(ends) == {"learner-2", "learner-3"}
    assert report["slots_without_summary"] == {}
    assert not [e for e in tape if e["kind"] in ("killed", "not_restarted")]
    # Quorum adapted at once: rounds went on merging the two learners left, without waiting
    # out the leavers' leases (10 s).
    left = max(ends.values())
    after = sorted(
        c["committed_at"]
        for c in report["commits"]
        if c["committed_at"] > left + 1.0 and set(c["learners"]) <= {"learner-0", "learner-1"}
    )
    assert after, "no round merged after the leavers left"
    assert after[0] - left < 8.0, after[0] - left
    # Goodput counts each slot's own provisioned time: a leaver's ends when it was told to go.
    starts = slot_starts(tape)
    end = max(float(e["t"]) for e in tape if e["kind"] == "training_ended")
    own = sum(min(end, ends.get(slot, end)) - start for slot, start in starts.items())
    assert abs(report["provisioned_seconds"] - own) < 0.5, (report["provisioned_seconds"], own)
