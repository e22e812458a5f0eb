"""The discrete-event simulator: training jobs as state machines advancing in virtual time.

Three modes, one failure model (`sim.model.FailureModel`), one goodput definition
(`services.goodput`: useful chip-seconds over provisioned chip-seconds):

- `dp`: data-parallel without elasticity. Any interruption stops the whole job: after
  detection, the failed slice is replaced and every chip restarts from the last checkpoint
  (work since it is lost). Interruptions during a restart are absorbed by it.
- `elastic_dp`: the job shrinks around a failed slice (detection, then a re-shard pause;
  the step in progress is lost) and grows back (another re-shard) once the slice is
  replaced; in between it runs on fewer chips.
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
from synchronizer.rounds import RoundPolicy, required_quorum

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
    rng = random.Random(seed)
    slice_chips = min(m.slice_chips, chips)
    slices = max(1, chips // slice_chips)
    events = [(at, "fail") for at in _poisson_times(rng, m.failure_rate(chips), 0.0, m.horizon_s)]
    heapq.heapify(events)
    t = paused_until = m.startup_s
    out = 0  # slices missing now
    useful = paused = 0.0
    counts = {"interruptions": 0, "reshards": 0}

    def advance(until: float) -> None:
        nonlocal t, useful, paused
        start = min(max(t, paused_until), until)
        paused += start - t if t >= m.startup_s else 0.0
        useful += (until - start) * (slices - min(out, slices)) / slices
        t = until

    while events:
        at, kind = heapq.heappop(events)
        if at >= m.horizon_s:
            break
        advance(max(at, t))
        if kind == "fail":
            counts["interruptions"] += 1
            out += 1
            if at >= paused_until:  # a new pause; one already under way takes this one in
                useful -= min(m.step_s, max(0.0, at - m.startup_s))  # the lost step
                paused_until = at + m.detect_s + m.reshard_s
                counts["reshards"] += 1
            heapq.heappush(events, (at + m.detect_s + m.replace_s, "back"))
        else:  # the replaced slice joins: the job grows back (in a re-shard under way, if any)
            out -= 1
            if at >= paused_until:
                paused_until = at + m.reshard_s
                counts["reshards"] += 1
    advance(m.horizon_s)
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
