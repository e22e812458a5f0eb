from typing import Any

from cluster.check import RECOMMIT_SLACK_S, check_tape, recommit_summary, recommits, summarize
from synchronizer.ownership import OWNER_TTL_S


def _run(
    replace: dict[int, dict[str, Any]] | None = None, add: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"t": 0.0, "who": "cluster", "kind": "launched", "learner": "l0"},
        {"t": 1.0, "who": "s0", "kind": "accepted", "uid": "l0/i/1"},
        {"t": 1.1, "who": "l0", "kind": "acked", "uid": "l0/i/1", "status": "accepted"},
        {"t": 1.2, "who": "s0", "kind": "accepted", "uid": "l0/i/2"},
        {"t": 2.0, "who": "s0", "kind": "merged", "fragment": 0, "version": 1,
         "uids": ["l0/i/1"], "useful_seconds": 1.0, "checksum": 11},
        {"t": 3.0, "who": "s0", "kind": "merged", "fragment": 0, "version": 2,
         "uids": ["l0/i/2"], "useful_seconds": 1.0, "checksum": 22},
        {"t": 4.0, "who": "l0", "kind": "finished", "checksums": [22]},
        {"t": 5.0, "who": "cluster", "kind": "run_ended", "pending": []},
    ]  # fmt: skip
    for index, event in (replace or {}).items():
        events[index] = event
    return events + (add or [])


def test_a_clean_run_passes() -> None:
    inv = check_tape(_run())
    assert inv.ok, inv.problems
    assert summarize(_run())["goodput"] == round(2.0 / 5.0, 4)


def test_a_gap_in_versions_is_found() -> None:
    gap = {"t": 3.0, "who": "s0", "kind": "merged", "fragment": 0, "version": 3,
           "uids": ["l0/i/2"], "checksum": 22}  # fmt: skip
    inv = check_tape(_run(replace={5: gap}))
    assert not inv.ok
    assert any("not consecutive" in p for p in inv.problems)


def test_an_update_in_two_commits_is_double_applied() -> None:
    again = {"t": 3.5, "who": "s1", "kind": "merged", "fragment": 0, "version": 3,
             "uids": ["l0/i/2"], "checksum": 22}  # fmt: skip
    inv = check_tape(_run(add=[again]))
    assert inv.double_applied == 1


def test_two_commits_of_one_round_with_different_updates_is_a_split_brain() -> None:
    other = {"t": 3.1, "who": "s1", "kind": "merged", "fragment": 0, "version": 2,
             "uids": ["l0/i/9"], "checksum": 23}  # fmt: skip
    inv = check_tape(_run(add=[other]))
    assert any("committed twice" in p for p in inv.problems)


def test_an_acknowledged_update_never_merged_is_lost_unless_pending() -> None:
    extra = {"t": 1.3, "who": "s0", "kind": "accepted", "uid": "l0/i/3"}
    assert check_tape(_run(add=[extra])).lost_updates == 1
    pending = {"t": 5.0, "who": "cluster", "kind": "run_ended", "pending": ["l0/i/3"]}
    assert check_tape(_run(add=[extra], replace={7: pending})).ok


def test_a_learner_ending_off_the_global_model_is_found() -> None:
    stale = {"t": 4.0, "who": "l0", "kind": "finished", "checksums": [11]}
    inv = check_tape(_run(replace={6: stale}))
    assert inv.problems == ["learner l0 does not hold the final global model"]


def test_an_update_dropped_with_its_round_and_its_sender_is_not_lost() -> None:
    # l1's update is received by s0, which dies before merging it: s1 owns the fragment anew.
    # l1's incarnation is killed before it can send it again: both copies are gone, which the
    # protocol allows (a learner keeps an update until it is committed, not beyond its life).
    received = {"t": 1.3, "who": "s0", "kind": "accepted", "uid": "l1/a/1", "fragment": 0}
    owned = {"t": 1.5, "who": "s1", "kind": "owned", "fragment": 0, "epoch": 2}
    inv = check_tape(_run(add=[received, owned]))
    assert inv.ok, inv.problems
    assert inv.dropped_with_sender == 1
    # The same, but its incarnation lived to finish: it should have sent it again.
    finished = {"t": 4.5, "who": "l1", "kind": "finished", "incarnation": "a", "checksums": [22]}
    inv = check_tape(_run(add=[received, owned, finished]))
    assert inv.lost_updates == 1
    # Received again after the new owner took the fragment, and never merged: lost.
    again = {"t": 1.6, "who": "s1", "kind": "accepted", "uid": "l1/a/1", "fragment": 0}
    assert check_tape(_run(add=[received, owned, again])).lost_updates == 1


def test_rounds_die_by_their_owners_epochs_not_by_when_lines_were_written() -> None:
    # s1 wrote its line of owning fragment 0 (epoch 2) before s0's line of receiving l1's
    # update under epoch 1 reached the tape: by time the update outlived its round, by
    # epoch it died with it.
    owned = {"t": 1.3, "who": "s1", "kind": "owned", "fragment": 0, "epoch": 2}
    late = {"t": 1.4, "who": "s0", "kind": "accepted", "uid": "l1/a/1", "fragment": 0, "epoch": 1}
    inv = check_tape(_run(add=[owned, late]))
    assert (inv.ok, inv.dropped_with_sender) == (True, 1), inv.problems
    # Received again under the new epoch and never merged: lost, whatever the times say.
    again = {**late, "t": 1.2, "who": "s1", "epoch": 2}
    assert check_tape(_run(add=[owned, late, again])).lost_updates == 1


def _owners_run(
    commits: dict[str, float | None] | None = None, drop: tuple[int, ...] = ()
) -> list[dict[str, Any]]:
    """Two replicas: s0 owns fragments 0 and 1, s1 fragment 2. s0 is killed at 10 s and s1
    owns its fragments at 18.5 s; Redis restarts at 40 s; training ends at 60 s. Update
    (sent at, fragment, committed at): `commits` moves commits (None: never), `drop` leaves
    out events by index."""
    events: list[dict[str, Any]] = [
        {"t": 1.0, "who": "s0", "kind": "owned", "fragment": 0, "epoch": 1},
        {"t": 1.0, "who": "s0", "kind": "owned", "fragment": 1, "epoch": 1},
        {"t": 1.0, "who": "s1", "kind": "owned", "fragment": 2, "epoch": 1},
        {"t": 10.0, "who": "cluster", "kind": "killed", "synchronizer": "s0"},
        {"t": 18.5, "who": "s1", "kind": "owned", "fragment": 0, "epoch": 2},
        {"t": 18.5, "who": "s1", "kind": "owned", "fragment": 1, "epoch": 2},
        {"t": 40.0, "who": "cluster", "kind": "fault", "fault": "redis-restart"},
        {"t": 60.0, "who": "cluster", "kind": "training_ended", "versions": [9, 9, 9]},
    ]
    events = [e for i, e in enumerate(events) if i not in drop]
    updates = {
        "u0": (4.0, 0, 5.0),  # committed before the kill: not the kill's
        "u1": (9.0, 0, 19.0),  # in flight at the kill: 9 s after it
        "u2": (12.0, 1, 21.0),  # sent while fragment 1 had no owner: 9 s after its sending
        "u3": (12.0, 2, 12.5),  # fragment 2's owner lived
        "u4": (39.5, 2, 44.0),  # in flight at Redis's restart: 4 s after it
        "u5": (41.0, 0, 41.5),  # sent after the restart
        "u6": (45.0, 1, 46.0),  # fragment 1 commits again after the restart
        "u7": (13.0, 0, None),  # refused once merged could be (stale): not waited for
    }
    for version, (uid, (sent, p, done)) in enumerate(updates.items(), 1):
        done = (commits or {}).get(uid, done)
        events.append({"t": sent, "who": "l0", "kind": "sent", "uid": uid, "fragment": p})
        if done is not None:
            merged = {"fragment": p, "version": version, "uids": [uid]}
            events.append({"t": done, "who": "s1", "kind": "merged", **merged})
    return events


def test_a_fault_is_timed_by_the_ownership_and_the_updates_it_held_up() -> None:
    found = {(r["fault"], r["fragment"]): r for r in recommits(_owners_run())}
    assert {
        k: (r["owned_s"], r["updates"], r["uncommitted"], r["seconds"]) for k, r in found.items()
    } == {
        ("synchronizer-kill", 0): (8.5, 2, 1, 9.0),
        ("synchronizer-kill", 1): (8.5, 1, 0, 9.0),
        ("redis-restart", 0): (None, 1, 1, 0.0),
        ("redis-restart", 1): (None, 0, 0, 0.0),
        ("redis-restart", 2): (None, 1, 0, 4.0),
    }
    summary = recommit_summary(_owners_run())
    assert summary["late"] == 0
    assert summary["slowest_s"] == 9.0
    assert summary["bound_s"] == OWNER_TTL_S + RECOMMIT_SLACK_S


def test_a_fragment_never_owned_or_committed_again_or_an_update_held_up_too_long_is_late() -> None:
    # Fragment 1 is never owned again (its update never commits); u1 commits 20 s late.
    events = _owners_run(commits={"u1": 30.0, "u2": None}, drop=(5,))
    late = {
        (r["fault"], r["fragment"], r["seconds"]) for r in recommit_summary(events)["late_detail"]
    }
    assert late == {("synchronizer-kill", 0, 20.0), ("synchronizer-kill", 1, None)}
    # A replica killed 2 s before training ended: nothing could be held to the bound.
    near_end = [
        *_owners_run(),
        {"t": 58.0, "who": "cluster", "kind": "killed", "synchronizer": "s1"},
    ]
    assert not [r for r in recommits(near_end) if r["t"] == 58.0]


def test_a_fragment_that_never_commits_after_a_redis_restart_is_late() -> None:
    events = _owners_run(commits={"u6": None})
    late = recommit_summary(events)["late_detail"]
    assert [(r["fault"], r["fragment"], r["seconds"]) for r in late] == [("redis-restart", 1, None)]
