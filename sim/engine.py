"""The discrete-event simulator: training jobs as state machines advancing in virtual time.

Three modes, one failure model (`sim.model.FailureModel`), one goodput definition
(`services.goodput`: useful chip-seconds over provisioned chip-seconds):

- `dp`: data-parallel without elasticity. Any interruption stops the whole job: after
  detection, the failed slice is replaced and every chip restarts from the last checkpoint
  (work since it is lost). Interruptions during a restart are absorbed by it.
- `elastic_dp`: a failed slice stalls the job until detected; one re-shard (taking in
  every failure that comes while the job is stalled) re-forms it on fewer slices, losing
  the step in flight. Replaced slices join at the next re-shard, or at one of their own
  once waiting has cost as much as a re-shard; in between the job runs on fewer chips.
- `decoupled`: M learners of chips/M chips each and a synchronizer. An interruption stops
  only its learner: after detection and the slice's replacement the learner rejoins,
  fetching the global model (no checkpoint reload), and loses its progress since its last
  sync. The others keep training; merges need a quorum of K live learners (`rounds`
  shares the rule with the real synchronizer), so with fewer live learners the others stall.

Transient slowdowns make a data-parallel job step at the pace of its slowest slice; in
decoupled mode only the slowed learner is slower, and nobody waits for it.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Literal

from services.goodput import goodput
from sim.model import FailureModel
from synchronizer.core.rounds import RoundPolicy, required_quorum

Mode = Literal["dp", "elastic_dp", "decoupled"]


@dataclass
class Result:
    mode: str
    chips: int
    learners: int
    useful_s: float  # chip-seconds
    provisioned_s: float  # chip-seconds
    uptime: float  # share of time the job (or the average learner) was training
    events: dict[str, int] = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return goodput(self.useful_s, self.provisioned_s)


def _poisson_times(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    times: list[float] = []
    if rate <= 0:
        return times
    t = start + rng.expovariate(rate)
    while t < end:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _slow_fraction(m: FailureModel, chips: int) -> float:
    """Share of time a job of `chips` chips has at least one slowed slice (steady state)."""
    rate = m.slowdown_rate_per_chip_year * chips / (365.0 * 24 * 3600)
    return 1.0 - math.exp(-rate * m.slowdown_s)


def _pace(m: FailureModel, chips: int) -> float:
    """Useful share of a data-parallel job's training time: everyone waits for the slowest
    slice (static heterogeneity: the expected maximum over slices; transient slowdowns)."""
    slices = max(1, chips // m.slice_chips)
    slowest = 1.0 + m.step_cv * math.sqrt(2.0 * math.log(slices)) if slices > 1 else 1.0
    slowed = _slow_fraction(m, chips)
    mean_step = slowest * (1.0 + slowed * (m.slowdown_factor - 1.0))
    return 1.0 / mean_step


def simulate_dp(m: FailureModel, chips: int, seed: int) -> Result:
    rng = random.Random(seed)
    rate = m.failure_rate(chips)
    cost, interval = m.checkpoint_cost_s, m.checkpoint_interval_s
    down_s = m.detect_s + m.replace_s + m.restart_s
    t = m.startup_s  # training resumes at t
    useful = up_total = 0.0
    counts = {"interruptions": 0, "restarts": 0, "checkpoints": 0}

    def train(until: float, interrupted: bool) -> None:
        nonlocal useful, up_total
        up = until - t
        done = int(up // (interval + cost))
        counts["checkpoints"] += done
        # Interrupted: work since the last checkpoint is lost. At the horizon: all counts.
        useful += done * interval if interrupted else up - done * cost
        up_total += up

    for at in _poisson_times(rng, rate, 0.0, m.horizon_s):
        counts["interruptions"] += 1
        if at < t:  # during start-up or a restart: absorbed by it
            continue
        train(at, interrupted=True)
        counts["restarts"] += 1
        t = at + down_s
    if t < m.horizon_s:
        train(m.horizon_s, interrupted=False)
    pace = _pace(m, chips)
    return Result(
        "dp", chips, 1, useful * pace * chips, m.horizon_s * chips, up_total / m.horizon_s, counts
    )


def simulate_elastic_dp(m: FailureModel, chips: int, seed: int) -> Result:
    """Elastic data-parallel as elastic training systems run it (docs/simulator.md):

    - A failed slice stalls the job's collectives until it is detected; then one re-shard
      re-forms the job on the slices left. Failures that come while the job is stalled or
      re-sharding are taken in by that re-shard: concurrent failures share one.
    - The step in flight when the job stalls is lost; state is replicated in memory, so
      nothing before it is.
    - A replaced slice loads the model from a peer while the job trains, then waits as a
      spare. Spares join at the job's next re-shard (a failure's, which costs them nothing
      more); if none comes, they get a re-shard of their own once the capacity they have
      waited out equals one re-shard of the whole job (break-even: growing sooner pauses
      more than it gains, later loses more than the pause).
    """
    rng = random.Random(seed)
    slice_chips = min(m.slice_chips, chips)
    slices = max(1, chips // slice_chips)
    failures = _poisson_times(rng, m.failure_rate(chips), 0.0, m.horizon_s)
    replaced: list[float] = []  # when each failed slice is back, its state loaded
    t = paused_until = reshard_starts = m.startup_s
    out = spares = 0  # slices not in the job; of them, replaced ones waiting to join
    useful = paused = waited = 0.0  # waited: job-seconds of capacity spares have waited
    counts = {"interruptions": 0, "reshards": 0, "grow_reshards": 0}

    def advance(until: float) -> None:
        nonlocal t, useful, paused, waited
        start = min(max(t, paused_until), until)
        paused += start - t if t >= m.startup_s else 0.0
        useful += (until - start) * (slices - out) / slices
        waited += (until - start) * spares / slices
        t = until

    def reshard(at: float) -> None:
        """A re-shard starting at `at`: spares join it."""
        nonlocal paused_until, reshard_starts, out, spares, waited
        reshard_starts, paused_until = at, at + m.reshard_s
        out, spares, waited = out - spares, 0, 0.0
        counts["reshards"] += 1

    i = 0
    while True:
        grow_at = math.inf
        if spares:
            grow_at = max(t, paused_until) + (m.reshard_s - waited) * slices / spares
        at = min(
            failures[i] if i < len(failures) else math.inf,
            replaced[0] if replaced else math.inf,
            grow_at,
            m.horizon_s,
        )
        advance(max(at, t))
        if at >= m.horizon_s:
            break
        if i < len(failures) and at == failures[i]:
            i += 1
            counts["interruptions"] += 1
            if at < m.startup_s:
                continue  # the start-up schedules around it
            out += 1
            heapq.heappush(replaced, at + m.detect_s + m.replace_s)
            if at >= paused_until:  # the job stalls now; a stall under way takes this one in
                useful -= min(m.step_s, at - m.startup_s)  # the step in flight
                reshard(at + m.detect_s)
                paused_until = at + m.detect_s + m.reshard_s
        elif replaced and at == replaced[0]:
            heapq.heappop(replaced)
            if at <= reshard_starts:
                out -= 1  # back before the re-shard under way starts: it joins that one
            else:
                spares += 1
        else:
            counts["grow_reshards"] += 1
            reshard(at)
    pace = _pace(m, chips)
    return Result(
        "elastic_dp",
        chips,
        1,
        max(0.0, useful) * pace * chips,
        m.horizon_s * chips,
        1.0 - paused / m.horizon_s,
        counts,
    )


@dataclass(frozen=True)
class Outage:
    """A learner down from `at` for `down_s` (then it rejoins)."""

    at: float
    learner: int
    down_s: float
    lost_s: float | None = None  # work it loses; None: the model's H*step/2


def simulate_decoupled(
    m: FailureModel,
    chips: int,
    learners: int,
    seed: int,
    outages: list[Outage] | None = None,
    startup_s: list[float] | None = None,
    lost_s: float | None = None,
    horizon_s: float | None = None,
) -> Result:
    """M learners of chips/M chips. `outages` replaces the Poisson interruptions (a replayed
    tape, each outage with its own down time); `startup_s` gives each learner's start-up;
    `lost_s` the work one interruption loses (default half a sync period, H*step/2)."""
    rng = random.Random(seed)
    horizon = m.horizon_s if horizon_s is None else horizon_s
    if outages is None:
        down = m.detect_s + m.replace_s + m.rejoin_s
        outages = [
            Outage(at, rng.randrange(learners), down)
            for at in _poisson_times(rng, m.failure_rate(chips), 0.0, horizon)
        ]
    pending = sorted(outages, key=lambda o: o.at)
    back = list(startup_s or [m.startup_s] * learners)  # each learner trains from back[i]
    lost_each = m.inner_steps * m.step_s / 2.0 if lost_s is None else lost_s
    policy = RoundPolicy(
        mode="decoupled",
        quorum=m.quorum,
        overlap_steps=m.overlap_steps,
        gamma=0.0,
        fixed_grace_s=m.grace_s,
    )
    useful = stalled = lost = down_total = 0.0
    counts = {"interruptions": 0, "rejoins": 0}
    t, idx = 0.0, 0
    while t < horizon:
        # Until the next change, the set of live learners is fixed.
        until = min(
            pending[idx].at if idx < len(pending) else horizon,
            min((b for b in back if b > t), default=horizon),
            horizon,
        )
        live = sum(1 for b in back if b <= t)
        if live and live >= required_quorum(policy, learners):
            useful += (until - t) * live
        else:  # too few learners for a merge: the live ones stall
            stalled += (until - t) * live
        t = until
        while idx < len(pending) and pending[idx].at <= t:
            o = pending[idx]
            idx += 1
            counts["interruptions"] += 1
            if back[o.learner] <= o.at:  # it was training: its unsynced work is lost
                each = lost_each if o.lost_s is None else o.lost_s
                loss = min(each, o.at - back[o.learner])
                useful -= loss
                lost += loss
                counts["rejoins"] += 1
                down_total += o.down_s
                back[o.learner] = o.at + o.down_s
            else:  # already down: its rejoin takes this one in
                end = max(back[o.learner], o.at + o.down_s)
                down_total += end - back[o.learner]
                back[o.learner] = end
    per = chips / learners
    provisioned = horizon * learners
    return Result(
        "decoupled",
        chips,
        learners,
        max(0.0, useful) * per,
        provisioned * per,
        1.0 - (stalled + down_total) / provisioned,
        {**counts, "lost_seconds": round(lost), "stalled_seconds": round(stalled)},
    )


def simulate(m: FailureModel, mode: Mode, chips: int, learners: int = 8, seed: int = 0) -> Result:
    """One job of `chips` chips in `mode`."""
    if mode == "dp":
        return simulate_dp(m, chips, seed)
    if mode == "elastic_dp":
        return simulate_elastic_dp(m, chips, seed)
    return simulate_decoupled(m, chips, learners, seed)
