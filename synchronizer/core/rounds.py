"""When a round of one fragment merges: minimum quorum, then the adaptive grace window.

Pure functions over times in seconds; the caller supplies the clock. `round_state` gathers
what the rule reads from an owner's open round and the job's live learners; `decide` rules.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol


def grace_window(
    *,
    overlap_steps: int,
    step_time_s: float,
    t_quorum_s: float,
    t_sync_s: float,
    gamma: float,
) -> float:
    """Paper Eq. 3: wait for stragglers only as long as the overlap hides it.

    slack = tau*step_time - (t_quorum + t_sync); grace = gamma * max(0, slack).
    """
    slack = overlap_steps * step_time_s - (t_quorum_s + t_sync_s)
    return gamma * max(0.0, slack)


@dataclass(frozen=True)
class LiveLearner:
    learner: str
    step_time_ema_s: float  # 0 when not reported yet
    finished: bool  # sent its last update
    still_to_send: frozenset[int] | None  # finishing: fragments it still sends; None: not


@dataclass(frozen=True)
class Live:
    """The job's live learners at one instant of the control store's clock."""

    now_s: float
    learners: tuple[LiveLearner, ...]


@dataclass(frozen=True)
class RoundState:
    """What is known of one fragment's open round, as read from the store."""

    contributors: int  # distinct learners with a pending update
    live_learners: int
    opened_at: float  # when the round opened (last commit or init)
    quorum_at: float | None  # when the round first reached quorum
    deadline: float | None  # when the grace window ends
    now: float
    finished_learners: int = 0  # live learners that have sent their last update
    # Live learners that may still send an update to this round (not in it, not finished, not
    # finishing without this fragment still to send); None: not known.
    waiting: int | None = None
    # Seconds until each update already streaming into this round is expected in (from how
    # fast its chunks have come so far).
    streaming_eta_s: tuple[float, ...] = ()
    # When the round's earliest update began arriving; None: none yet.
    first_update_at: float | None = None
    # How long the round's members can wait for the rest without their next update of this
    # fragment waiting on it: one fragment period (H steps) of the slowest member; None: not
    # known.
    patience_s: float | None = None


# A policy's quorum that stands for every live learner still training.
EVERY_LIVE_LEARNER = 0


@dataclass(frozen=True)
class RoundPolicy:
    mode: str  # "decoupled" or "sync"
    quorum: int  # K; EVERY_LIVE_LEARNER (0): each live learner still training
    overlap_steps: int
    gamma: float
    fixed_grace_s: float | None
    max_grace_s: float = float("inf")  # the adaptive window never waits longer than this


@dataclass(frozen=True)
class Decision:
    merge_now: bool
    # Set when the round reaches quorum now: the deadline to record, and the grace behind it.
    new_deadline: float | None = None
    grace_s: float | None = None
    # Not merged only because an update streaming in is waited for (`coalescing`): the round
    # is still in its window.
    held: bool = False


def required_quorum(policy: RoundPolicy, live_learners: int) -> int:
    """K for a round.

    Sync mode: every learner of the job, as classic DiLoCo: at least the configured quorum
    (the job's M) and every live learner, so a missing learner stops the job until it is back.
    Decoupled mode: the configured quorum, or every live learner if fewer are alive (waiting
    for learners that do not exist helps no one); with EVERY_LIVE_LEARNER, each of them (a
    round then waits for a straggler no longer than its members' patience, `decide`).
    """
    if policy.mode == "sync":
        return max(1, policy.quorum, live_learners)
    if policy.quorum == EVERY_LIVE_LEARNER:
        return max(1, live_learners)
    return max(1, min(policy.quorum, live_learners)) if live_learners else policy.quorum


def straggler_waited_out(state: RoundState, policy: RoundPolicy) -> bool:
    """Whether a decoupled round waiting for every live learner (EVERY_LIVE_LEARNER) has
    waited long enough for the ones not in it: as long as its members can wait without their
    next update of the fragment being held up (one fragment period of the slowest member, as
    the learners keep training while their update is in a round), never past
    --max-grace-seconds. Learners of one speed whose schedules are offset in time all arrive
    within one period; a slower one does not hold the others back longer than that."""
    if policy.quorum != EVERY_LIVE_LEARNER or state.first_update_at is None:
        return False
    patience = min(
        state.patience_s if state.patience_s is not None else policy.max_grace_s,
        policy.max_grace_s,
    )
    return state.now - state.first_update_at >= patience


# The merge time `coalescing` assumes before a fragment's owner has merged once (its first
# round, or its first since it took the fragment over): a first round's updates are all
# provisional, and sealing it under updates still arriving moves each of them.
FIRST_MERGE_S = 1.0


def coalescing(state: RoundState, policy: RoundPolicy, t_sync_s: float) -> bool:
    """Whether a round that could merge now waits for an update already streaming into it.

    It does when that update is expected in before one merge's time (t_sync, the fragment's
    recent merges) has passed since the round reached quorum. Merging without it would seal
    the round under it, move what of it was summed to the next round, and give it a merge of
    its own, which starts only once this one has ended: waiting commits it sooner, and this
    round's members by at most t_sync later, for one merge instead of two. Decoupled rounds
    under the adaptive window only (a fixed window is what its user asked for; a sync round
    waits for everyone anyway); never past --max-grace-seconds. Before any merge,
    FIRST_MERGE_S stands for t_sync.
    """
    if policy.mode != "decoupled" or policy.fixed_grace_s is not None:
        return False
    since = state.now - state.quorum_at if state.quorum_at is not None else 0.0
    window = t_sync_s if t_sync_s > 0.0 else FIRST_MERGE_S
    left = min(window, policy.max_grace_s) - since
    return left > 0.0 and any(eta <= left for eta in state.streaming_eta_s)


def decide(
    state: RoundState, policy: RoundPolicy, *, slowest_step_s: float, t_sync_s: float
) -> Decision:
    if state.contributors == 0:
        return Decision(merge_now=False)
    training = state.live_learners - state.finished_learners
    if state.live_learners and training <= 0:
        # Every live learner has sent its last update: nothing more is coming, so waiting
        # (for quorum or grace) only delays the end, or, in sync mode, never ends (a learner
        # restored near the end sends a last update after the others finished). Merge what
        # is left now.
        return Decision(merge_now=True)
    if policy.mode == "decoupled" and state.live_learners and state.waiting == 0:
        # No live learner can add to this round any more (each is in it, or has stopped
        # stepping with nothing more for this fragment): a grace window would wait for no one.
        return Decision(merge_now=True)
    if policy.mode == "decoupled":
        k = required_quorum(policy, training)
    else:
        k = required_quorum(policy, state.live_learners)
    everyone_in = state.contributors >= max(k, state.live_learners)
    if state.quorum_at is None:
        if state.contributors < k:
            waited = policy.mode == "decoupled" and straggler_waited_out(state, policy)
            return Decision(merge_now=waited)
        if policy.mode == "sync" or everyone_in:
            grace = 0.0
        elif policy.fixed_grace_s is not None:
            grace = policy.fixed_grace_s
        else:
            grace = min(
                policy.max_grace_s,
                grace_window(
                    overlap_steps=policy.overlap_steps,
                    step_time_s=slowest_step_s,
                    t_quorum_s=max(0.0, state.now - state.opened_at),
                    t_sync_s=t_sync_s,
                    gamma=policy.gamma,
                ),
            )
        held = grace <= 0.0 and not everyone_in and coalescing(state, policy, t_sync_s)
        return Decision(
            merge_now=grace <= 0.0 and not held,
            new_deadline=state.now + grace,
            grace_s=grace,
            held=held,
        )
    deadline = state.deadline if state.deadline is not None else state.quorum_at
    if everyone_in or state.now < deadline:
        return Decision(merge_now=everyone_in)
    held = coalescing(state, policy, t_sync_s)
    return Decision(merge_now=not held, held=held)


@dataclass
class RoundTimes:
    """When an owner's open round opened, first reached quorum and ends its grace window,
    when its newest member was received, and when it was last held for an update streaming
    in (the owner's monotonic clock, seconds)."""

    opened_at: float
    quorum_at: float | None = None
    deadline: float | None = None
    last_received: float = 0.0
    held_at: float = 0.0

    def decided(self, decision: Decision, now: float) -> None:
        """What the rule decided at `now`: quorum reached (a deadline set), or held."""
        if decision.new_deadline is not None:
            self.quorum_at, self.deadline = now, decision.new_deadline
        if decision.held:
            self.held_at = now

    def ready(self, now: float) -> float:
        """When a round merging at `now` was ready: once its last update was in, or its
        grace window ended (the last time it was held for an update streaming in, if
        later)."""
        window = max(self.deadline or 0.0, self.held_at)
        return max(self.last_received, min(window, now))

    def reopen(self, now: float) -> None:
        """A new round opens at `now` (a commit, or a value loaded); members received
        meanwhile stay received."""
        self.opened_at, self.quorum_at, self.deadline, self.held_at = now, None, None, 0.0


class Arriving(Protocol):
    """An update streaming into a round: how many of its values have come, and when and how
    many came with its first chunk."""

    @property
    def arrived(self) -> int: ...
    @property
    def first_at(self) -> float: ...
    @property
    def first_values(self) -> int: ...


def round_state(
    live: Live,
    *,
    fragment: int,
    size: int,
    contributors: Collection[str],
    sending: Collection[str],
    streaming: Iterable[Arriving],
    first_update_at: float | None,
    times: RoundTimes,
    now: float,
    inner_steps: int,
) -> tuple[RoundState, float]:
    """An open round as the rule reads it, and the slowest live learner's step time.
    `contributors`, `sending`: the slots with an update received into the round, or still
    streaming in; `streaming`: the updates arriving into this round (not one moved on to
    the next), each expected in at the pace its chunks came after its first (an update
    covers the whole fragment of `size` values); none before its second chunk."""
    finished = sum(1 for lv in live.learners if lv.finished)
    waiting = sum(
        1
        for lv in live.learners
        if not lv.finished
        and lv.learner not in contributors
        and (lv.still_to_send is None or fragment in lv.still_to_send)
    )
    waiting += len(set(sending) - {lv.learner for lv in live.learners})
    etas = tuple(
        (size - u.arrived) * (now - u.first_at) / (u.arrived - u.first_values)
        for u in streaming
        if u.arrived > u.first_values
    )
    members = [lv for lv in live.learners if lv.learner in contributors]
    slowest_member = max((lv.step_time_ema_s for lv in members), default=0.0)
    state = RoundState(
        contributors=len(contributors),
        live_learners=len(live.learners),
        opened_at=times.opened_at,
        quorum_at=times.quorum_at,
        deadline=times.deadline,
        now=now,
        finished_learners=finished,
        waiting=waiting,
        streaming_eta_s=etas,
        first_update_at=first_update_at,
        patience_s=inner_steps * slowest_member if slowest_member else None,
    )
    slowest = max((lv.step_time_ema_s for lv in live.learners), default=0.0)
    return state, slowest
