"""Faults injected into a running `atoll up` cluster, as cluster.chaos schedules them.

Each kind of fault that chaos.KINDS declares has its action in ACTIONS, beside it: what the
fault does to its victim now, and what undoes it once its duration is over (a killed child
started again, a paused one resumed, a learner's links healed). A fault whose victim is
already down is moot. Times are seconds since training began (`FaultInjector.run_due`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any, Protocol

from cluster.chaos import KINDS, NETWORK_KINDS, Fault
from cluster.faultproxy import FaultProxy
from cluster.processes import Child, SynchronizerChild
from cluster.redis_server import RedisServer
from services.tape import Tape


class Cluster(Protocol):
    """What a fault reaches in the cluster it is injected into."""

    learners: list[Child]
    synchronizers: list[SynchronizerChild]
    redis: RedisServer | None
    proxy: FaultProxy | None
    tape: Tape

    def whom(self, child: Child) -> dict[str, Any]: ...

    def bring_back(self, child: Child) -> None: ...


# An action: the fault done to its victim now; returns what undoes it, if anything does.
Undo = Callable[[], None]
Action = Callable[["FaultInjector", Fault], Undo | None]


class FaultInjector:
    """The run's fault schedule, and what the faults injected so far have left to undo."""

    def __init__(self, cluster: Cluster, faults: list[Fault], started: float) -> None:
        self.cluster = cluster
        self.faults = faults  # still to come, in time order
        self.started = started  # the run's start, for each fault's `injected_at_s`
        self.injected: list[dict[str, Any]] = []
        self.down: set[str] = set()  # children a fault stopped on purpose
        self._undo: list[tuple[float, Child, Undo]] = []  # (when, whose, what)

    def run_due(self, now: float, ending: bool) -> None:
        """Undo what is due to be undone, then inject the faults due by `now` (none once
        the run is `ending`: the rest of the schedule is dropped)."""
        for entry in [x for x in self._undo if x[0] <= now]:
            if entry not in self._undo:
                continue  # gone with its child (`forget`)
            self._undo.remove(entry)
            entry[2]()
        while self.faults and self.faults[0].at_s <= now:
            fault = self.faults.pop(0)
            if ending:
                self.faults.clear()
                return
            self._inject(fault, now)

    def forget(self, child: Child) -> None:
        """The child is not brought back, resumed or healed: its slot has ended."""
        self.down.discard(child.name)
        self._undo = [x for x in self._undo if x[1] is not child]

    def _inject(self, fault: Fault, now: float) -> None:
        child = self._victim(fault)
        stops = fault.kind not in NETWORK_KINDS  # a network fault is never moot
        if child is not None and stops and (not child.alive() or child.name in self.down):
            return  # already down: this fault is moot
        undo = ACTIONS[fault.kind](self, fault)
        if undo is not None:
            assert child is not None
            self._undo.append((now + fault.duration_s, child, undo))
        self.injected.append(
            {**fault.as_dict(), "injected_at_s": round(time.time() - self.started, 3)}
        )
        self.cluster.tape.write(
            "fault", **{"fault" if k == "kind" else k: v for k, v in fault.as_dict().items()}
        )

    def _victim(self, fault: Fault) -> Child | None:
        """The child a fault hits (None: Redis)."""
        whom = KINDS[fault.kind][0]
        if whom == "redis":
            return None
        if whom == "synchronizers":
            return self.cluster.synchronizers[fault.victim]
        return self.cluster.learners[fault.victim]

    # --- the actions ----------------------------------------------------------------------
    def _kill(self, fault: Fault) -> Undo:
        child = self._victim(fault)
        assert child is not None
        self.down.add(child.name)
        child.kill()
        self.cluster.tape.write("killed", **self.cluster.whom(child))

        def start() -> None:
            self.down.discard(child.name)
            self.cluster.bring_back(child)

        return start

    def _pause(self, fault: Fault) -> Undo:
        child = self._victim(fault)
        assert child is not None
        child.signal(signal.SIGSTOP)
        self.cluster.tape.write("paused", **self.cluster.whom(child))

        def resume() -> None:
            child.signal(signal.SIGCONT)
            self.cluster.tape.write("resumed", **self.cluster.whom(child))

        return resume

    def _restart_redis(self, _: Fault) -> None:
        assert self.cluster.redis is not None
        self.cluster.redis.restart(signal.SIGKILL)

    def _proxy(self) -> FaultProxy:
        assert self.cluster.proxy is not None
        return self.cluster.proxy

    def _reset(self, fault: Fault) -> None:
        self._proxy().reset(fault.victim)

    def _latency(self, fault: Fault) -> Undo:
        self._proxy().latency(fault.victim, fault.amount)
        return self._heal(fault)

    def _bandwidth(self, fault: Fault) -> Undo:
        self._proxy().bandwidth(fault.victim, fault.amount)
        return self._heal(fault)

    def _partition(self, fault: Fault) -> Undo:
        self._proxy().partition(fault.victim, True)
        return self._heal(fault)

    def _heal(self, fault: Fault) -> Undo:
        def heal() -> None:
            self._proxy().heal(fault.victim)
            self.cluster.tape.write(
                "healed", **self.cluster.whom(self.cluster.learners[fault.victim])
            )

        return heal


ACTIONS: dict[str, Action] = {
    "learner-kill": FaultInjector._kill,
    "learner-pause": FaultInjector._pause,
    "synchronizer-kill": FaultInjector._kill,
    "redis-restart": FaultInjector._restart_redis,
    "net-latency": FaultInjector._latency,
    "net-bandwidth": FaultInjector._bandwidth,
    "net-reset": FaultInjector._reset,
    "net-partition": FaultInjector._partition,
}
assert ACTIONS.keys() == KINDS.keys(), "every kind of fault chaos.KINDS declares has an action"
