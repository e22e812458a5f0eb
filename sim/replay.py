"""`atoll sim --tape TAPE`: a real run, replayed in the simulator, and what-ifs on it.

From the tape come the run's learners, each slot's start-up (launch to first step), every
interruption (when, whom, how long until that learner stepped again, how many steps it
lost: its last step before the kill against the step it resumed from), its step time, and
two efficiencies: the share of a live learner's time spent in inner steps, and the share of
that compute which entered a commit (what overlap and refusals cost). The simulator then
replays the interruptions against learners built from those numbers. What-ifs change the
interruptions (`--mtbf`: Poisson, with the run's mean down time and loss), the number of
learners or the quorum, keeping everything measured.
"""

from __future__ import annotations

import random
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from services import goodput as gp
from sim.engine import Outage, simulate_decoupled
from sim.model import FailureModel


@dataclass
class Measured:
    learners: list[str]
    start: float
    end: float
    startup_s: list[float]
    outages: list[Outage]
    step_s: float
    compute_share: float  # inner-step compute / live time
    merge_share: float  # merged compute / compute not lost to interruptions
    quorum: int
    goodput: float
    notes: dict[str, Any] = field(default_factory=dict)


def measure(events: list[dict[str, Any]]) -> Measured:
    starts = gp.slot_starts(events)
    if not starts:
        raise ValueError("the tape has no learner launches; record one with `atoll up --tape`")
    names = sorted(starts)
    t0, end = min(starts.values()), gp.training_end(events)
    steps: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["kind"] == "step" and e["who"] in starts and e["t"] <= end:
            steps[str(e["who"])].append(e)
    startup = []
    for name in names:
        first = steps[name][0]["t"] - steps[name][0]["seconds"] if steps[name] else end
        startup.append(first - t0)
    outages, lost_steps = [], []
    for kill in (e for e in events if e["kind"] == "killed" and e.get("learner") in starts):
        name = str(kill["learner"])
        before = [s for s in steps[name] if s["t"] <= kill["t"]]
        after = [s for s in steps[name] if s["t"] > kill["t"]]
        resumed = next(
            (
                j
                for j in events
                if j["kind"] == "joined" and j["who"] == name and j["t"] > kill["t"]
            ),
            None,
        )
        back = (after[0]["t"] - after[0]["seconds"]) if after else end
        last = int(before[-1]["step"]) if before else 0
        lost = max(0, last - int(resumed["step"])) if resumed is not None else last
        lost_steps.append(lost)
        outages.append(Outage(kill["t"] - t0, names.index(name), back - kill["t"], float(lost)))
    seconds = [float(s["seconds"]) for name in names for s in steps[name][1:]]
    step_s = statistics.median(seconds) if seconds else 1.0
    outages = [Outage(o.at, o.learner, o.down_s, (o.lost_s or 0.0) * step_s) for o in outages]
    compute = sum(float(s["seconds"]) for name in names for s in steps[name])
    down = {
        i: [(o.at, o.at + o.down_s) for o in outages if o.learner == i] for i in range(len(names))
    }
    live = sum(
        (end - t0 - startup[i]) - sum(min(b, end - t0) - a for a, b in down[i])
        for i in range(len(names))
    )
    useful = sum(float(c.get("useful_seconds", 0.0)) for c in gp.commits(events).values())
    lost_total = sum((o.lost_s or 0.0 for o in outages), 0.0)
    run = next((e for e in events if e["kind"] == "run_started"), {})
    return Measured(
        learners=names,
        start=t0,
        end=end,
        startup_s=startup,
        outages=outages,
        step_s=step_s,
        compute_share=compute / live if live > 0 else 1.0,
        merge_share=useful / max(1e-9, compute - lost_total),
        quorum=int(run.get("quorum", 1) or 1),
        goodput=gp.from_tape(events).goodput,
        notes={"interruptions": len(outages), "lost_steps": lost_steps},
    )


def replay(
    events: list[dict[str, Any]],
    *,
    mtbf_s: float | None = None,
    learners: int = 0,
    quorum: int = 0,
    grace_s: float | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    m = measure(events)
    horizon = m.end - m.start
    count = learners or len(m.learners)
    startup = [m.startup_s[i % len(m.startup_s)] for i in range(count)]
    outages = m.outages
    if mtbf_s is not None or count != len(m.learners):
        rng = random.Random(seed)
        rate = 1.0 / mtbf_s if mtbf_s else len(outages) / horizon if outages else 0.0
        down = statistics.mean(o.down_s for o in outages) if outages else 10.0
        lost = statistics.mean(o.lost_s or 0.0 for o in outages) if outages else 0.0
        outages = []
        t = rng.expovariate(rate) if rate else horizon
        while t < horizon:
            outages.append(Outage(t, rng.randrange(count), down, lost))
            t += rng.expovariate(rate)
    model = FailureModel(
        quorum=quorum or m.quorum,
        grace_s=grace_s if grace_s is not None else 0.0,
        step_s=m.step_s,
    )
    result = simulate_decoupled(
        model, count, count, seed, outages=outages, startup_s=startup, horizon_s=horizon
    )
    simulated = result.goodput * m.compute_share * m.merge_share
    return {
        "measured_goodput": round(m.goodput, 4),
        "simulated_goodput": round(simulated, 4),
        "learners": count,
        "interruptions": len(outages),
        "training_seconds": round(horizon, 3),
        "step_seconds": round(m.step_s, 4),
        "compute_share": round(m.compute_share, 4),
        "merge_share": round(m.merge_share, 4),
        "uptime": round(result.uptime, 4),
        "what_if": {
            "mtbf_s": mtbf_s,
            "learners": learners or None,
            "quorum": quorum or None,
            "grace_s": grace_s,
        },
        "measured": m.notes,
    }
