"""The ticks of a learner of several processes: the leader decides, every process applies.

Process 0, the leader, keeps the learner's control session (hello, heartbeats, the one live
session per slot), asking to be told new versions rather than sent their values. Between two
steps every process takes a *tick* (learner/group.py): the leader publishes what it knows
(how many new versions every process is to adopt, the final acks, the owner map, whether the
job is finished, whether to stop, whether to stop waiting) and every process, the leader
included, applies exactly that. The outer bookkeeping is deterministic, so every process
makes the same decisions (what is due, what is in flight, which seq an update has) on its
own values.

Versions: the leader hands on each version it is told of as an event; the versions thread
of every process fetches its ranges of it as soon as it is published, and a tick that names
it hands it over (waiting only if this process's own fetch is not in yet).

Threads: `tick` runs on the loop's thread; the versions thread (`follow`) fetches.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from learner.client import RangeValues, SynchronizerClient
from learner.group import Group
from services.gen.atoll.v1 import session_pb2

log = structlog.get_logger("atoll.learner")
# Ticks are kept in blocks of this many; the block before the last is dropped as a new one
# starts (the processes' steps keep them within a step or two of each other).
TICKS_KEPT = 1000
FETCH_TIMEOUT_S = 300.0  # a process whose fetch of a named version has not come gives up


@dataclass(frozen=True)
class Verdict:
    """What one tick hands every process: the new versions to adopt, in order, and whether
    to stop waiting."""

    events: list[RangeValues]
    halt: bool


class Ticks:
    """One learner's decisions between two steps, shared by its processes through `group`."""

    def __init__(
        self,
        group: Group,
        client: SynchronizerClient,
        stop_requested: threading.Event,
        stopping: threading.Event,
    ) -> None:
        """`stop_requested`: a stop asked of this process (the leader's counts);
        `stopping`: set on every process at the tick that hands the leader's on."""
        self.group, self.client = group, client
        self.stop_requested, self.stopping = stop_requested, stopping
        self.finished = False
        self.final: dict[int, session_pb2.Ack] = {}
        self.owners_told: list[session_pb2.FragmentOwner] = []
        self._ticks = itertools.count()
        self._relayed: set[int] = set()
        self._applied = 0  # events handed over
        self._events: dict[int, RangeValues] = {}  # fetched, not handed over yet
        self._fetched = threading.Condition()
        self._failed: BaseException | None = None
        self._closed = threading.Event()

    def tick(self, wait: float = 0.0, halt: bool = False) -> Verdict:
        """One decision for every process (the leader's after waiting up to `wait` for
        news; `halt`: the leader stops waiting)."""
        n = next(self._ticks)
        key = f"tick/{n // TICKS_KEPT}/{n}"
        if self.group.leader:
            verdict = self._decide(wait, halt)
            self.group.publish(key, verdict)
            if n % TICKS_KEPT == 0 and n >= 2 * TICKS_KEPT:  # read long ago by every process
                self.group.forget(f"tick/{n // TICKS_KEPT - 2}")
        else:
            verdict = self.group.read(key)
        for raw in verdict["acks"]:
            ack = session_pb2.Ack.FromString(bytes.fromhex(raw))
            self.final[ack.seq] = ack
            if not self.group.leader:
                self.client.settle(ack)
        if verdict["owners"] is not None and not self.group.leader:
            owners = session_pb2.OwnerMap.FromString(bytes.fromhex(verdict["owners"]))
            self.client.set_owners(owners.owners)
        self.finished = bool(verdict["finished"])
        if verdict["stop"]:
            self.stopping.set()
        return Verdict(self._take_events(int(verdict["events"])), bool(verdict["halt"]))

    def _decide(self, wait: float, halt: bool) -> dict[str, Any]:
        """The leader's tick: what it knows now (after waiting up to `wait` for news)."""
        deadline = time.monotonic() + wait
        while True:
            acks = {s: a for s, a in self.client.final_acks().items() if s not in self._relayed}
            with self._fetched:
                events = self._applied + len(self._events)
                if acks or events > self._applied or time.monotonic() >= deadline:
                    break
                self._fetched.wait(min(0.01, max(0.0, deadline - time.monotonic())))
        self._relayed |= set(acks)
        owners = sorted(self.client.owners.values(), key=lambda o: o.fragment)
        told = None
        if owners != self.owners_told:
            self.owners_told = owners
            told = session_pb2.OwnerMap(owners=owners).SerializeToString().hex()
        return {
            "events": events,
            "acks": [a.SerializeToString().hex() for _, a in sorted(acks.items())],
            "owners": told,
            "finished": self.client.job_finished,
            "stop": self.stop_requested.is_set(),
            "halt": halt,
        }

    def _take_events(self, through: int) -> list[RangeValues]:
        """The fetched versions up to event `through`, in order (waiting for this process's
        own fetches of them, if need be)."""
        out = []
        deadline = time.monotonic() + FETCH_TIMEOUT_S
        with self._fetched:
            while self._applied < through:
                if self._failed is not None:
                    raise self._failed
                got = self._events.pop(self._applied, None)
                if got is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError("this process's fetch of a new version never came")
                    self._fetched.wait(0.1)
                    continue
                out.append(got)
                self._applied += 1
        return out

    # --- versions: the leader hands them on, every process fetches its own ranges --------
    def follow(self, fetch: Callable[[int, int, threading.Event], RangeValues]) -> None:
        """Start the versions thread: `fetch(fragment, version, closed)` this process's
        ranges of each version the leader hands on."""
        threading.Thread(
            target=self._follow, args=(fetch,), name="atoll-versions", daemon=True
        ).start()

    def _follow(self, fetch: Callable[[int, int, threading.Event], RangeValues]) -> None:
        structlog.contextvars.bind_contextvars(
            learner=self.client.learner_id, process=self.group.process
        )
        try:
            for i in itertools.count():
                event = self._next_event(i)
                if event is None:
                    return
                got = fetch(*event, self._closed)
                with self._fetched:
                    self._events[i] = got
                    self._fetched.notify_all()
        except BaseException as err:  # the next tick raises it in the loop's thread
            with self._fetched:
                self._failed = err
                self._fetched.notify_all()

    def _next_event(self, i: int) -> tuple[int, int] | None:
        while not self._closed.is_set():
            if self.group.leader:
                try:
                    p, version = self.client.notices.get(timeout=0.5)
                except queue.Empty:
                    continue
                self.group.publish(f"event/{i}", [p, version])
                return p, version
            try:
                p, version = self.group.read(f"event/{i}", timeout_s=1.0)
                return int(p), int(version)
            except Exception:  # not published yet
                continue
        return None

    def close(self) -> None:
        self._closed.set()
