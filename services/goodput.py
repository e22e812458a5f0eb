"""Goodput, defined once (ARCHITECTURE.md): useful learner-seconds over provisioned ones.

Provisioned: every learner slot's wall time from its first launch to the end of training
(or to when it left the job), dead and restarting time included. Useful: inner-step compute
time whose outer gradient entered a committed merge, a step counting 1/P for each of its
fragments merged (the synchronizer sums that at commit: `useful_seconds`). The run report,
`atoll check` and `atoll sim` all compute it here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def provisioned_seconds(slot_starts: Mapping[str, float], end: float) -> float:
    """Learner-seconds provisioned: each slot from its first launch until `end`."""
    return sum(max(0.0, end - start) for start in slot_starts.values())


def slot_seconds(
    starts: Mapping[str, float], ends: Mapping[str, float], now: float
) -> dict[str, float]:
    """Each slot's provisioned seconds so far: from its first launch until its own end (it
    left, or training ended) or `now`."""
    return {slot: max(0.0, min(now, ends.get(slot, now)) - start) for slot, start in starts.items()}


@dataclass
class Release:
    """Useful seconds released as they accrue: an acknowledged update credits several steps'
    compute at once, and a counter that took it in one lump would make a windowed goodput
    read above 1. Credit enters a backlog that flows out no faster than wall time (a learner
    cannot compute more than one second per second), so over any window a learner's
    released useful time is at most its provisioned time."""

    released: float = 0.0
    backlog: float = 0.0
    since: float | None = None

    def credit(self, seconds: float) -> None:
        self.backlog += max(0.0, seconds)

    def release(self, now: float) -> float:
        """Move up to the wall time since the last call out of the backlog; the total."""
        if self.since is not None:
            out = min(self.backlog, max(0.0, now - self.since))
            self.released += out
            self.backlog -= out
        self.since = now
        return self.released


def goodput(useful_s: float, provisioned_s: float) -> float:
    return useful_s / provisioned_s if provisioned_s > 0 else 0.0


def commits(events: Iterable[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    """Merged events by (fragment, version): the committing replica wrote each, the cluster
    filled in those a replica killed right after its commit could not."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for e in events:
        if e["kind"] == "merged":
            out.setdefault((int(e["fragment"]), int(e["version"])), e)
    return out


@dataclass(frozen=True)
class TapeGoodput:
    useful_s: float
    provisioned_s: float
    goodput: float
    learners: int
    start: float
    end: float


def slot_starts(events: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each learner slot's first launch."""
    starts: dict[str, float] = {}
    for e in events:
        if e["kind"] == "launched":
            starts.setdefault(str(e["learner"]), float(e["t"]))
    return starts


def slot_ends(events: Sequence[dict[str, Any]]) -> dict[str, float]:
    """When each learner slot that left the job (`atoll up --scale`) was told to leave."""
    return {str(e["learner"]): float(e["t"]) for e in events if e["kind"] == "left"}


def training_end(events: Sequence[dict[str, Any]]) -> float:
    """When training ended: the cluster's `training_ended`, else the run's end, else the
    last event (a tape cut short)."""
    for kind in ("training_ended", "run_ended"):
        ends = [float(e["t"]) for e in events if e["kind"] == kind]
        if ends:
            return ends[0]
    return max((float(e["t"]) for e in events), default=0.0)


def from_tape(events: Sequence[dict[str, Any]]) -> TapeGoodput:
    starts = slot_starts(events)
    end = training_end(events)
    useful = sum(float(c.get("useful_seconds", 0.0)) for c in commits(events).values())
    provisioned = sum(slot_seconds(starts, slot_ends(events), end).values())
    return TapeGoodput(
        useful_s=useful,
        provisioned_s=provisioned,
        goodput=goodput(useful, provisioned),
        learners=len(starts),
        start=min(starts.values(), default=end),
        end=end,
    )
