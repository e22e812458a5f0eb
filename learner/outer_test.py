from itertools import pairwise

import numpy as np
import pytest

from learner.outer import (
    ACK_WAIT_S,
    FragmentState,
    due_fragments,
    fragment_offset,
    merge_global,
    sync_round,
)
from services import codec as codecs


@pytest.mark.parametrize(("fragments", "inner_steps"), [(1, 10), (4, 40), (3, 10), (8, 8)])
def test_each_fragment_once_per_h_steps_staggered_by_h_over_p(
    fragments: int, inner_steps: int
) -> None:
    sends: dict[int, list[int]] = {p: [] for p in range(fragments)}
    for step in range(1, 10 * inner_steps + 1):
        for p in due_fragments(step, fragments, inner_steps):
            sends[p].append(step)
    for p, steps in sends.items():
        assert len(steps) == 10, p
        assert all(b - a == inner_steps for a, b in pairwise(steps))
    firsts = sorted(steps[0] for steps in sends.values())
    gaps = {b - a for a, b in pairwise(firsts)}
    assert gaps <= {inner_steps // fragments, inner_steps // fragments + 1}
    assert firsts[-1] == inner_steps
    assert fragment_offset(fragments - 1, fragments, inner_steps) == 0


def test_merge_with_alpha() -> None:
    theta = np.array([1.0, 2.0], np.float32)
    glob = np.array([3.0, 6.0], np.float32)
    np.testing.assert_array_equal(merge_global(theta, glob, 0.0), glob)
    np.testing.assert_allclose(merge_global(theta, glob, 0.25), [2.5, 5.0])


def state(version: int = 0) -> FragmentState:
    return FragmentState(
        np.zeros(4, np.float32), version, codecs.ErrorFeedback(codecs.by_name("fp32"), 0)
    )


def test_only_the_reply_to_a_send_is_adopted() -> None:
    f = state()
    # Another learner's round: remembered, not adopted (no unsent progress is overwritten).
    assert not f.receive(np.ones(4, np.float32), 1)
    assert f.latest_version == 1
    assert f.version == 0
    f.count(tokens=100, seconds=0.5)
    send = f.begin_send()
    assert (send.version, send.steps, send.tokens) == (0, 1, 100)
    payload = f.encode(send, np.full(4, -1.0, np.float32))
    assert np.frombuffer(payload[0].data, "<f4").tolist() == [1.0] * 4
    assert f.in_flight
    assert f.awaiting_above == 1
    # Version 1 again, or anything not newer than what was known at send: not the reply.
    assert not f.receive(np.ones(4, np.float32), 1)
    assert f.receive(np.full(4, 2.0, np.float32), 2)
    f.adopt(np.full(4, 2.0, np.float32), 2)
    assert not f.in_flight
    assert (f.steps, f.tokens, f.version) == (0, 0, 2)


def sent(f: FragmentState, seq: int) -> None:
    f.count(tokens=100, seconds=0.5)
    f.encode(f.begin_send(), np.full(4, -1.0, np.float32))
    f.sent_seq = seq


def test_confirming_by_ack_a_version_sealed_without_the_update_is_not_adopted() -> None:
    # A round sealed while the update crossed the link: version 1 holds only another
    # learner's update, and the ack says version 2 holds this one.
    f = state()
    f.confirm_by_ack = True
    sent(f, seq=7)
    assert not f.receive(np.ones(4, np.float32), 1, now=5.0)  # held for the ack
    assert not f.confirmed(7, 2)  # merged by 2, which has not arrived
    assert not f.overdue(now=5.0 + 2 * ACK_WAIT_S)  # the ack came: nothing is overdue
    assert f.receive(np.full(4, 2.0, np.float32), 2, now=6.0)
    # An ack of some other update, or of none in flight, adopts nothing.
    f.adopt(np.full(4, 2.0, np.float32), 2)
    assert not f.confirmed(7, 2)


def test_confirming_by_ack_the_value_held_is_adopted_when_its_ack_comes() -> None:
    f = state()
    f.confirm_by_ack = True
    sent(f, seq=3)
    assert not f.receive(np.ones(4, np.float32), 1, now=5.0)
    assert not f.confirmed(4, 1)  # not this update's ack
    assert f.confirmed(3, 1)  # the value held is the reply


def test_confirming_by_ack_a_lost_ack_costs_ack_wait_s_then_the_first_newer_is_adopted() -> None:
    f = state()
    f.confirm_by_ack = True
    sent(f, seq=3)
    assert not f.overdue(now=100.0)  # nothing newer has come
    assert not f.receive(np.ones(4, np.float32), 1, now=5.0)
    assert not f.overdue(now=5.0 + ACK_WAIT_S / 2)
    assert f.overdue(now=5.0 + ACK_WAIT_S)
    f.adopt(np.ones(4, np.float32), 1)
    sent(f, seq=4)  # the next send starts its own wait
    assert not f.receive(np.full(4, 2.0, np.float32), 2, now=20.0)
    assert not f.overdue(now=21.0)


def test_a_late_reply_does_not_trigger_an_empty_send() -> None:
    f = state()
    f.count(tokens=10, seconds=0.1)
    f.begin_send()
    f.due = True  # due again while the reply is still in flight
    assert f.receive(np.ones(4, np.float32), 1)
    f.adopt(np.ones(4, np.float32), 1)
    assert not f.due
    assert f.steps == 0


def test_steps_taken_in_flight_survive_the_reply_and_count_next_time() -> None:
    f = state()
    f.count(tokens=10, seconds=0.5)
    send = f.begin_send()
    assert (send.steps, send.compute_seconds) == (1, 0.5)
    f.encode(send, np.full(4, -1.0, np.float32))  # the update took theta = -1
    f.count(tokens=10, seconds=0.25)  # a step while in flight: theta moved to -1.5
    theta = np.full(4, -1.5, np.float32)
    glob = np.full(4, 3.0, np.float32)
    assert f.receive(glob, 1)
    np.testing.assert_array_equal(f.local_value(theta, glob, 0.0), np.full(4, 2.5))
    f.adopt(glob, 1)
    assert (f.steps, f.tokens, f.compute_seconds) == (1, 10, 0.25)  # the kept step
    assert f.sent_theta is None
    # With nothing in flight, adopting overwrites (the end of a run, a refetch).
    np.testing.assert_array_equal(f.local_value(theta, glob, 0.0), glob)


def test_without_keep_progress_the_reply_overwrites_the_overlap() -> None:
    f = state()
    f.keep_progress = False
    f.count(tokens=10, seconds=0.5)
    send = f.begin_send()
    f.encode(send, np.full(4, -1.0, np.float32))
    f.count(tokens=10, seconds=0.25)
    glob = np.full(4, 3.0, np.float32)
    np.testing.assert_array_equal(f.local_value(np.full(4, -1.5, np.float32), glob, 0.0), glob)
    f.adopt(glob, 1)
    assert (f.steps, f.compute_seconds) == (0, 0.0)


def test_a_restored_fragment_moves_onto_the_current_global_keeping_its_progress() -> None:
    f = state(version=2)  # anchor 0 at version 2
    f.count(tokens=10, seconds=0.5)
    theta = np.full(4, -1.0, np.float32)  # one step of progress: -1
    glob = np.full(4, 5.0, np.float32)  # the job moved on to version 6
    np.testing.assert_array_equal(f.carry_onto(theta, glob, 6), np.full(4, 4.0))
    assert (f.version, f.steps, f.compute_seconds) == (6, 1, 0.5)  # based on v6 now
    np.testing.assert_array_equal(f.base, glob)
    # With an update in flight: that update is the synchronizer's; only later progress stays.
    g = state(version=2)
    g.count(tokens=10, seconds=0.5)
    send = g.begin_send()
    g.encode(send, np.full(4, -1.0, np.float32))
    g.count(tokens=10, seconds=0.25)
    local = g.carry_onto(np.full(4, -1.5, np.float32), glob, 6)
    np.testing.assert_array_equal(local, np.full(4, 4.5))
    assert not g.in_flight
    assert (g.steps, g.compute_seconds) == (1, 0.25)


@pytest.mark.parametrize(("fragments", "inner_steps"), [(1, 10), (4, 40), (3, 10)])
def test_the_nth_due_step_of_a_fragment_is_its_nth_round(fragments: int, inner_steps: int) -> None:
    for p in range(fragments):
        due = [
            s
            for s in range(1, 6 * inner_steps + 1)
            if p in due_fragments(s, fragments, inner_steps)
        ]
        assert [sync_round(s, p, fragments, inner_steps) for s in due] == list(
            range(1, len(due) + 1)
        )
