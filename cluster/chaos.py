"""Fault injection for `atoll up --chaos SPEC --seed N`: the grammar and the schedule.

SPEC is one or more faults separated by `;`, each `KIND:key=value,key=value`:

    learner-kill:mtbf=30s,down=5s        SIGKILL a learner; restart it `down` later
    learner-pause:mtbf=60s,for=10s       SIGSTOP a learner (a straggler); SIGCONT after `for`
    synchronizer-kill:mtbf=120s,down=3s  SIGKILL a synchronizer replica; restart it on its port
    redis-restart:mtbf=300s              SIGKILL Redis and start it again at once (AOF on)

`mtbf` is the mean time between faults of that kind across the whole cluster (exponential
inter-arrival times; the victim is drawn uniformly), so a bigger cluster does not multiply
the fault rate. Instead of `mtbf`, `at=20s` (repeatable as `at=20s+50s`) places faults at
fixed times. `victim=2` pins the victim. Durations take `ms`, `s` or `m` (default seconds).
Times count from the first inner step of any learner, so start-up is not part of them. The
same SPEC, seed and horizon give the same schedule.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass
from typing import Any

KINDS = {
    "learner-kill": ("learners", {"down": 5.0}),
    "learner-pause": ("learners", {"for": 10.0}),
    "synchronizer-kill": ("synchronizers", {"down": 3.0}),
    "redis-restart": ("redis", {}),
}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m)?$")


class ChaosError(ValueError):
    """A --chaos SPEC that cannot be read; the message says what to write instead."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    mtbf_s: float | None
    at_s: tuple[float, ...]
    duration_s: float
    victim: int | None


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    victim: int
    duration_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_duration(text: str) -> float:
    match = _DURATION.match(text.strip())
    if not match:
        raise ChaosError(f"{text!r} is not a duration; write e.g. 30s, 500ms or 2m")
    value, unit = float(match.group(1)), match.group(2) or "s"
    return value * {"ms": 0.001, "s": 1.0, "m": 60.0}[unit]


def parse(spec: str) -> list[FaultSpec]:
    faults: list[FaultSpec] = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, _, params = part.partition(":")
        kind = kind.strip()
        if kind not in KINDS:
            raise ChaosError(f"unknown fault {kind!r}; known: {', '.join(KINDS)}")
        _, defaults = KINDS[kind]
        values: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in params.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ChaosError(f"{kind}: {item!r} is not key=value")
            values[key.strip()] = value.strip()
        allowed = {"mtbf", "at", "victim", *defaults}
        unknown = set(values) - allowed
        if unknown:
            raise ChaosError(f"{kind}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        if ("mtbf" in values) == ("at" in values):
            raise ChaosError(f"{kind}: give either mtbf=DURATION or at=DURATION[+DURATION...]")
        mtbf = parse_duration(values["mtbf"]) if "mtbf" in values else None
        if mtbf is not None and mtbf <= 0:
            raise ChaosError(f"{kind}: mtbf must be positive")
        at = tuple(parse_duration(t) for t in values["at"].split("+")) if "at" in values else ()
        (duration_key, default), *_ = list(defaults.items()) or [("", 0.0)]
        duration = parse_duration(values[duration_key]) if duration_key in values else default
        victim = int(values["victim"]) if "victim" in values else None
        faults.append(FaultSpec(kind, mtbf, at, duration, victim))
    if not faults:
        raise ChaosError("empty --chaos SPEC; e.g. 'learner-kill:mtbf=30s,down=5s'")
    return faults


def schedule(
    specs: list[FaultSpec], *, seed: int, horizon_s: float, population: dict[str, int]
) -> list[Fault]:
    """Every fault of the run, in time order, from a seeded generator."""
    rng = random.Random(seed)
    out: list[Fault] = []
    for spec in specs:
        group, _ = KINDS[spec.kind]
        size = population.get(group, 0)
        if size < 1:
            raise ChaosError(f"{spec.kind}: the cluster has no {group} to fault")
        if spec.victim is not None and not 0 <= spec.victim < size:
            raise ChaosError(f"{spec.kind}: victim={spec.victim} must be in 0..{size - 1}")
        times = list(spec.at_s)
        if spec.mtbf_s is not None:
            t = rng.expovariate(1.0 / spec.mtbf_s)
            while t < horizon_s:
                times.append(t)
                t += rng.expovariate(1.0 / spec.mtbf_s)
        for t in times:
            victim = spec.victim if spec.victim is not None else rng.randrange(size)
            out.append(Fault(round(t, 3), spec.kind, victim, spec.duration_s))
    return sorted(out, key=lambda f: (f.at_s, f.kind, f.victim))
