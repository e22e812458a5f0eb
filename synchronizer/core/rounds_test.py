from dataclasses import dataclass

import pytest

from synchronizer.core.rounds import (
    Decision,
    Live,
    LiveLearner,
    RoundPolicy,
    RoundState,
    RoundTimes,
    decide,
    grace_window,
    required_quorum,
    round_state,
)

POLICY = RoundPolicy(mode="decoupled", quorum=2, overlap_steps=10, gamma=0.8, fixed_grace_s=None)


def state(contributors: int, live: int = 4, **kw: float | None) -> RoundState:
    base = {"opened_at": 100.0, "quorum_at": None, "deadline": None, "now": 101.0}
    base.update(kw)
    return RoundState(contributors=contributors, live_learners=live, **base)  # type: ignore[arg-type]


def test_grace_window_is_eq3() -> None:
    # slack = tau*step - (t_quorum + t_sync) = 10*0.5 - (1.0 + 0.2) = 3.8; grace = 0.8*3.8
    assert grace_window(
        overlap_steps=10, step_time_s=0.5, t_quorum_s=1.0, t_sync_s=0.2, gamma=0.8
    ) == pytest.approx(3.04)
    # No slack left: no grace.
    assert (
        grace_window(overlap_steps=2, step_time_s=0.1, t_quorum_s=1.0, t_sync_s=0.2, gamma=0.8) == 0
    )


def test_no_merge_below_quorum() -> None:
    assert not decide(state(1), POLICY, slowest_step_s=0.5, t_sync_s=0.2).merge_now


def test_quorum_opens_the_adaptive_grace_window() -> None:
    d = decide(state(2), POLICY, slowest_step_s=0.5, t_sync_s=0.2)
    assert not d.merge_now
    assert d.grace_s is not None
    assert d.grace_s == pytest.approx(0.8 * (10 * 0.5 - (1.0 + 0.2)))
    assert d.new_deadline == pytest.approx(101.0 + d.grace_s)


def test_merge_when_the_grace_window_ends_or_everyone_is_in() -> None:
    waiting = state(2, quorum_at=101.0, deadline=104.0, now=103.0)
    assert not decide(waiting, POLICY, slowest_step_s=0.5, t_sync_s=0.2).merge_now
    ended = state(2, quorum_at=101.0, deadline=104.0, now=104.0)
    assert decide(ended, POLICY, slowest_step_s=0.5, t_sync_s=0.2).merge_now
    everyone = state(4, quorum_at=101.0, deadline=104.0, now=102.0)
    assert decide(everyone, POLICY, slowest_step_s=0.5, t_sync_s=0.2).merge_now


def test_fixed_grace_overrides_eq3() -> None:
    policy = RoundPolicy("decoupled", 2, 10, 0.8, fixed_grace_s=0.0)
    assert decide(state(2), policy, slowest_step_s=0.5, t_sync_s=0.2).merge_now


def test_sync_mode_waits_for_every_learner_without_grace() -> None:
    policy = RoundPolicy("sync", 1, 10, 0.8, None)
    assert required_quorum(policy, 4) == 4
    assert not decide(state(3), policy, slowest_step_s=0.5, t_sync_s=0.2).merge_now
    assert decide(state(4), policy, slowest_step_s=0.5, t_sync_s=0.2).merge_now
    # The job's M learners, even while one of them is away.
    of_four = RoundPolicy("sync", 4, 10, 0.8, None)
    assert not decide(state(3, live=3), of_four, slowest_step_s=0.5, t_sync_s=0.2).merge_now


def test_decoupled_quorum_never_exceeds_the_live_learners() -> None:
    assert required_quorum(POLICY, 1) == 1
    assert required_quorum(POLICY, 4) == 2


def test_when_every_live_learner_has_finished_what_is_left_merges_below_quorum() -> None:
    policy = RoundPolicy("decoupled", 4, 5, 0.8, None)
    last = RoundState(1, 4, 0.0, None, None, 10.0, finished_learners=4)
    assert decide(last, policy, slowest_step_s=1.0, t_sync_s=0.0).merge_now
    training = RoundState(1, 4, 0.0, None, None, 10.0, finished_learners=2)
    assert not decide(training, policy, slowest_step_s=1.0, t_sync_s=0.0).merge_now  # K=2 now
    two = RoundState(2, 4, 0.0, None, None, 10.0, finished_learners=2)
    assert decide(two, policy, slowest_step_s=1.0, t_sync_s=0.0).new_deadline is not None
    # A grace window still open when the last learner finishes is not waited out.
    waiting = RoundState(2, 4, 0.0, 9.0, 14.0, 10.0, finished_learners=4)
    assert decide(waiting, policy, slowest_step_s=1.0, t_sync_s=0.0).merge_now
    # Sync mode too: one learner's last update, sent after the others finished, merges.
    sync = RoundPolicy("sync", 4, 5, 0.8, None)
    assert decide(last, sync, slowest_step_s=1.0, t_sync_s=0.0).merge_now
    assert not decide(training, sync, slowest_step_s=1.0, t_sync_s=0.0).merge_now


def test_a_round_no_live_learner_can_add_to_merges_without_waiting_out_its_grace() -> None:
    policy = RoundPolicy("decoupled", 1, 5, 0.8, 30.0)
    # Quorum reached, a 30 s grace window open, and one learner not in the round yet.
    open_ = RoundState(1, 2, 0.0, 1.0, 31.0, 2.0, waiting=1)
    assert not decide(open_, policy, slowest_step_s=1.0, t_sync_s=0.0).merge_now
    # That learner stopped stepping and has nothing more for this fragment.
    nobody = RoundState(1, 2, 0.0, 1.0, 31.0, 2.0, waiting=0)
    assert decide(nobody, policy, slowest_step_s=1.0, t_sync_s=0.0).merge_now
    # Unknown (an older store) keeps the grace window.
    unknown = RoundState(1, 2, 0.0, 1.0, 31.0, 2.0)
    assert not decide(unknown, policy, slowest_step_s=1.0, t_sync_s=0.0).merge_now
    # Sync mode waits for every learner of the job, finishing or not.
    sync = RoundPolicy("sync", 2, 5, 0.8, None)
    assert not decide(nobody, sync, slowest_step_s=1.0, t_sync_s=0.0).merge_now


def test_the_adaptive_grace_window_is_capped() -> None:
    from synchronizer.core.rounds import RoundPolicy, RoundState, decide

    policy = RoundPolicy(
        mode="decoupled", quorum=1, overlap_steps=5, gamma=0.8, fixed_grace_s=None, max_grace_s=30.0
    )
    state = RoundState(
        contributors=1, live_learners=2, opened_at=0.0, quorum_at=None, deadline=None, now=1.0
    )
    # A learner claiming an hour a step would hold the round open for four hours.
    decision = decide(state, policy, slowest_step_s=3600.0, t_sync_s=0.1)
    assert decision.grace_s == 30.0


def test_a_round_waits_for_an_update_streaming_in_for_at_most_a_merges_time() -> None:
    from synchronizer.core.rounds import RoundPolicy, RoundState, decide

    policy = RoundPolicy("decoupled", 1, 5, 0.8, None)

    def at(now: float, quorum_at: float | None, *etas: float) -> RoundState:
        return RoundState(
            contributors=1,
            live_learners=3,
            opened_at=0.0,
            quorum_at=quorum_at,
            deadline=quorum_at,
            now=now,
            waiting=2,
            streaming_eta_s=etas,
        )

    # Quorum now, no slack for a grace window (step 0.01 s): merge, unless an update streaming
    # in is expected within a merge's time (0.8 s).
    assert decide(at(10.0, None), policy, slowest_step_s=0.01, t_sync_s=0.8).merge_now
    assert decide(at(10.0, None, 1.5), policy, slowest_step_s=0.01, t_sync_s=0.8).merge_now
    held = decide(at(10.0, None, 2.0, 0.3), policy, slowest_step_s=0.01, t_sync_s=0.8)
    assert held.held
    assert not held.merge_now
    assert held.new_deadline == 10.0
    assert held.grace_s == 0.0
    # Later: still held while the update is expected before quorum + t_sync, not after.
    later = decide(at(10.5, 10.0, 0.2), policy, slowest_step_s=0.01, t_sync_s=0.8)
    assert later.held
    assert not later.merge_now
    assert decide(at(10.7, 10.0, 0.2), policy, slowest_step_s=0.01, t_sync_s=0.8).merge_now
    assert decide(at(10.5, 10.0), policy, slowest_step_s=0.01, t_sync_s=0.8).merge_now
    # No merge measured yet: a first merge is assumed to take FIRST_MERGE_S.
    first = decide(at(10.0, None, 0.9), policy, slowest_step_s=0.01, t_sync_s=0.0)
    assert first.held
    assert decide(at(10.0, None, 1.1), policy, slowest_step_s=0.01, t_sync_s=0.0).merge_now
    # A fixed window: nothing is held.
    fixed = RoundPolicy("decoupled", 1, 5, 0.8, 0.0)
    assert decide(at(10.0, None, 0.1), fixed, slowest_step_s=0.01, t_sync_s=0.8).merge_now
    # Never past the cap on grace windows, and not at all under a cap of zero.
    capped = RoundPolicy("decoupled", 1, 5, 0.8, None, max_grace_s=0.2)
    assert decide(at(10.0, None, 0.3), capped, slowest_step_s=0.01, t_sync_s=0.8).merge_now
    none = RoundPolicy("decoupled", 1, 5, 0.8, None, max_grace_s=0.0)
    assert decide(at(10.0, None, 0.0), none, slowest_step_s=0.01, t_sync_s=0.8).merge_now
    # Every live learner in (one counted whose update is also still streaming): merge now.
    everyone = RoundState(
        contributors=3,
        live_learners=3,
        opened_at=0.0,
        quorum_at=None,
        deadline=None,
        now=10.0,
        waiting=1,
        streaming_eta_s=(0.1,),
    )
    assert decide(everyone, policy, slowest_step_s=0.01, t_sync_s=0.8).merge_now


def test_every_live_learner_by_default_and_a_straggler_is_waited_for_one_period() -> None:
    every = RoundPolicy(
        mode="decoupled", quorum=0, overlap_steps=5, gamma=0.8, fixed_grace_s=None, max_grace_s=30
    )
    assert required_quorum(every, 3) == 3
    assert required_quorum(every, 0) == 1

    def at(now: float, contributors: int = 1) -> bool:
        round_ = state(contributors, live=3, now=now, first_update_at=100.0, patience_s=4.0)
        return decide(round_, every, slowest_step_s=0.5, t_sync_s=0.2).merge_now

    # Two of three in: the third is waited for one period of the members (4 s here).
    assert not at(101.0, 2)
    assert not at(103.9, 2)
    assert at(104.0, 2)
    # Everyone in: at once, no grace needed.
    assert at(100.5, 3)
    # The period is capped by --max-grace-seconds; unknown, the cap stands for it.
    long = state(1, live=3, now=131.0, first_update_at=100.0, patience_s=1e6)
    assert decide(long, every, slowest_step_s=0.5, t_sync_s=0.2).merge_now
    unknown = state(1, live=3, now=129.0, first_update_at=100.0)
    assert not decide(unknown, every, slowest_step_s=0.5, t_sync_s=0.2).merge_now
    # A configured K stays a hard minimum: no waiting out.
    k2 = state(1, live=3, now=1000.0, first_update_at=100.0, patience_s=4.0)
    assert not decide(k2, POLICY, slowest_step_s=0.5, t_sync_s=0.2).merge_now


@dataclass
class _Arriving:
    arrived: int
    first_at: float
    first_values: int


def test_a_rounds_state_counts_who_may_still_send_and_when_streaming_updates_come_in() -> None:
    """Live learners not in the round and not finished (or finishing with this fragment
    still to send) wait, and so do slots sending without a live session; an update
    streaming in is expected at the pace of its chunks after its first, none before its
    second; patience is H steps of the slowest member."""
    live = Live(
        now_s=0.0,
        learners=(
            LiveLearner("a", 0.5, False, None),  # a member
            LiveLearner("b", 2.0, False, None),  # waiting
            LiveLearner("c", 1.0, False, frozenset({3})),  # finishing, fragment 3 to send
            LiveLearner("d", 1.0, False, frozenset({1})),  # finishing, not this fragment
            LiveLearner("e", 1.0, True, None),  # finished
        ),
    )
    state, slowest = round_state(
        live,
        fragment=3,
        size=1024,
        contributors={"a"},
        sending={"b", "ghost"},
        streaming=[_Arriving(768, 10.0, 256), _Arriving(256, 11.0, 256)],
        first_update_at=9.0,
        times=RoundTimes(opened_at=5.0),
        now=12.0,
        inner_steps=10,
    )
    assert (state.contributors, state.live_learners, state.finished_learners) == (1, 5, 1)
    assert state.waiting == 3  # b, c, and the ghost sending without a session
    assert state.streaming_eta_s == pytest.approx((1.0,))  # 512 values in 2 s, 256 to come
    assert state.patience_s == 5.0  # 10 steps of the member's 0.5 s
    assert state.first_update_at == 9.0
    assert slowest == 2.0


def test_a_rounds_times_say_when_it_was_ready_and_reopen_keeping_its_members() -> None:
    times = RoundTimes(opened_at=10.0)
    times.last_received = 11.0
    times.decided(Decision(merge_now=False, new_deadline=14.0, grace_s=3.0), now=11.0)
    assert (times.quorum_at, times.deadline) == (11.0, 14.0)
    assert times.ready(now=12.0) == 12.0  # merged early (everyone in): ready now
    assert times.ready(now=20.0) == 14.0  # merged late: ready when its window ended
    times.decided(Decision(merge_now=False, held=True), now=16.0)
    assert times.ready(now=20.0) == 16.0  # held for an update streaming in until then
    times.last_received = 18.0
    assert times.ready(now=20.0) == 18.0  # its last member came later still
    times.reopen(now=21.0)
    assert (times.opened_at, times.quorum_at, times.deadline, times.held_at) == (
        21.0,
        None,
        None,
        0.0,
    )
    assert times.last_received == 18.0
