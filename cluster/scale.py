"""`atoll up --scale SPEC`: grow and shrink a running job, as an operator scales a pool.

SPEC is one or more events separated by `;`, each `at=DURATION,learners=N`, optionally
with `,ready=STEPS`:

    at=60s,learners=6;at=120s,learners=3,ready=20

`ready=STEPS` holds the event past its time until every slot in the job has reported at
least STEPS inner steps, so a shrink never removes a slot still starting (on a loaded
machine a new slot's start-up can outlast any fixed delay). A slot that never gets there
holds the event until `--timeout`; the live view and the tape say when it fired.

At each event the job gets N learner slots. New slots are numbered on from the highest so
far (learner-3, learner-4, ...): each starts as a restarted learner does, fetching the
global model, and its updates are merged like any other's. When N is below the slots
running, the newest leave: each is sent SIGTERM, does its final sync, ends its session (its
lease is dropped at once, so quorum and grace windows count only those still there) and
exits. A slot that left is not a fault: its provisioned time ends when it is told to leave.
Times count from the first inner step of any learner, as --chaos times do.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.chaos import ChaosError, parse_duration


@dataclass(frozen=True)
class ScaleEvent:
    at_s: float
    learners: int
    ready_steps: int = 0  # held until every slot has reported this many inner steps


def parse_scale(spec: str) -> list[ScaleEvent]:
    events: list[ScaleEvent] = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        values: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in part.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key.strip() not in ("at", "learners", "ready"):
                raise ChaosError(
                    f"--scale: {item!r}; write e.g. 'at=60s,learners=6' (ready=STEPS optional)"
                )
            values[key.strip()] = value.strip()
        if not {"at", "learners"} <= set(values):
            raise ChaosError(f"--scale: {part!r} needs both at=DURATION and learners=N")
        if not values["learners"].isdigit() or int(values["learners"]) < 1:
            raise ChaosError(f"--scale: learners={values['learners']} must be at least 1")
        ready = values.get("ready", "0")
        if not ready.isdigit():
            raise ChaosError(f"--scale: ready={ready} must be a whole number of inner steps")
        events.append(ScaleEvent(parse_duration(values["at"]), int(values["learners"]), int(ready)))
    return sorted(events, key=lambda e: e.at_s)


def slots_ever(initial: int, events: list[ScaleEvent]) -> int:
    """How many learner slots the job will have had: new slots are numbered on, so this
    many data shards keep every slot on its own."""
    running = total = initial
    for e in events:
        total += max(0, e.learners - running)
        running = e.learners
    return total
