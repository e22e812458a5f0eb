"""Fault injection for `atoll up --chaos SPEC --seed N`: the grammar and the schedule.

SPEC is one or more faults separated by `;`, each `KIND:key=value,key=value`:

    learner-kill:mtbf=30s,down=5s        SIGKILL a learner; restart it `down` later
    learner-pause:mtbf=60s,for=10s       SIGSTOP a learner (a straggler); SIGCONT after `for`
    synchronizer-kill:mtbf=120s,down=3s  SIGKILL a synchronizer replica; restart it on its port
    redis-restart:mtbf=300s              SIGKILL Redis and start it again at once (AOF on)
    net-latency:mtbf=60s,for=10s,delay=200ms
                                         a learner's links deliver every byte `delay` late
    net-bandwidth:mtbf=60s,for=10s,rate=256KB
                                         a learner's links carry at most `rate` bytes/s each way
    net-reset:mtbf=60s                   a learner's connections are aborted (RST)
    net-partition:mtbf=120s,for=15s      a learner is cut off from every synchronizer

Network faults go through a fault proxy on loopback that `atoll up` puts between each learner
and each synchronizer (only when the SPEC has a network fault).

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

# kind -> (whom it hits, {duration key: default}, (amount key, default) or None)
KINDS: dict[str, tuple[str, dict[str, float], tuple[str, float] | None]] = {
    "learner-kill": ("learners", {"down": 5.0}, None),
    "learner-pause": ("learners", {"for": 10.0}, None),
    "synchronizer-kill": ("synchronizers", {"down": 3.0}, None),
    "redis-restart": ("redis", {}, None),
    "net-latency": ("learners", {"for": 10.0}, ("delay", 0.2)),
    "net-bandwidth": ("learners", {"for": 10.0}, ("rate", 256e3)),
    "net-reset": ("learners", {}, None),
    "net-partition": ("learners", {"for": 15.0}, None),
}
NETWORK_KINDS = frozenset(k for k in KINDS if k.startswith("net-"))
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m)?$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(B|KB|MB|GB)?(?:/s)?$", re.IGNORECASE)


class ChaosError(ValueError):
    """A --chaos SPEC that cannot be read; the message says what to write instead."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    mtbf_s: float | None
    at_s: tuple[float, ...]
    duration_s: float
    victim: int | None
    amount: float = 0.0  # net-latency: seconds of delay; net-bandwidth: bytes per second


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    victim: int
    duration_s: float
    amount: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_duration(text: str) -> float:
    match = _DURATION.match(text.strip())
    if not match:
        raise ChaosError(f"{text!r} is not a duration; write e.g. 30s, 500ms or 2m")
    value, unit = float(match.group(1)), match.group(2) or "s"
    return value * {"ms": 0.001, "s": 1.0, "m": 60.0}[unit]


def parse_rate(text: str) -> float:
    """Bytes per second: `256KB`, `1MB/s`, `500000` (decimal units)."""
    match = _RATE.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise ChaosError(f"{text!r} is not a rate; write e.g. 256KB, 1MB/s or 500000 (bytes/s)")
    unit = (match.group(2) or "B").upper()
    return float(match.group(1)) * {"B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit]


def parse(spec: str) -> list[FaultSpec]:
    faults: list[FaultSpec] = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, _, params = part.partition(":")
        kind = kind.strip()
        if kind not in KINDS:
            raise ChaosError(f"unknown fault {kind!r}; known: {', '.join(KINDS)}")
        _, defaults, extra = KINDS[kind]
        values: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in params.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ChaosError(f"{kind}: {item!r} is not key=value")
            values[key.strip()] = value.strip()
        allowed = {"mtbf", "at", "victim", *defaults, *([extra[0]] if extra else [])}
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
        amount = 0.0
        if extra is not None:
            key, amount = extra
            if key in values:
                amount = (parse_rate if key == "rate" else parse_duration)(values[key])
        faults.append(FaultSpec(kind, mtbf, at, duration, victim, amount))
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
        group, _, _ = KINDS[spec.kind]
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
            out.append(Fault(round(t, 3), spec.kind, victim, spec.duration_s, spec.amount))
    return sorted(out, key=lambda f: (f.at_s, f.kind, f.victim))
