from services import goodput as gp


def _events() -> list[dict[str, object]]:
    return [
        {"t": 0.0, "kind": "launched", "learner": "a"},
        {"t": 1.0, "kind": "launched", "learner": "b"},
        {"t": 5.0, "kind": "launched", "learner": "a"},  # a restart: the slot began at 0
        {"t": 6.0, "kind": "merged", "fragment": 0, "version": 1, "useful_seconds": 4.0},
        {"t": 6.5, "kind": "merged", "fragment": 0, "version": 1, "useful_seconds": 4.0},
        {"t": 9.0, "kind": "merged", "fragment": 1, "version": 1, "useful_seconds": 3.0},
        {"t": 11.0, "kind": "training_ended"},
        {"t": 15.0, "kind": "run_ended"},
    ]


def test_provisioned_counts_each_slot_from_its_first_launch_to_the_end() -> None:
    assert gp.provisioned_seconds({"a": 0.0, "b": 1.0}, 11.0) == 21.0


def test_goodput_from_a_tape_counts_each_commit_once() -> None:
    g = gp.from_tape(_events())
    assert g.learners == 2
    assert g.provisioned_s == 21.0
    assert g.useful_s == 7.0  # the replayed line of fragment 0 version 1 counts once
    assert abs(g.goodput - 7.0 / 21.0) < 1e-12


def test_a_tape_cut_short_ends_at_its_last_event() -> None:
    events = [e for e in _events() if e["kind"] not in ("training_ended", "run_ended")]
    assert gp.training_end(events) == 9.0


def test_no_provisioned_time_is_zero_goodput() -> None:
    assert gp.goodput(5.0, 0.0) == 0.0


def test_slot_seconds_end_each_slot_at_its_own_end() -> None:
    starts = {"a": 0.0, "b": 10.0, "c": 50.0}
    assert gp.slot_seconds(starts, {"b": 30.0}, now=40.0) == {"a": 40.0, "b": 20.0, "c": 0.0}


def test_release_never_outpaces_wall_time() -> None:
    r = gp.Release(since=0.0)
    r.credit(5.0)  # one acknowledged update: five seconds of compute at once
    assert r.release(2.0) == 2.0
    assert r.release(2.5) == 2.5
    r.credit(1.0)
    assert r.release(10.0) == 6.0  # all of it, once enough wall time has passed
    assert r.backlog == 0.0
