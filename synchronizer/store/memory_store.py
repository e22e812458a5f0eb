"""The control store in a process's memory, for unit tests: the rules of `lua/` kept on
dicts, one method at a time (a method never awaits in the middle, so each is atomic on the
event loop as a script is in Redis). Leases run on `clock` (milliseconds; a test may move
it). Nothing outlives the process and nothing is shared between processes: never a
replica's store.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.config import INIT_CLAIM_S
from synchronizer.core.rounds import Live, LiveLearner
from synchronizer.store.control import LOG_KEEP, Commit, Hello, Pointer, SessionReopened


def _wall_ms() -> float:
    return time.time() * 1000.0


@dataclass
class _Slot:
    """One learner slot's record (the `learner` hash)."""

    incarnation: str = ""
    joins: int = 0
    fields: dict[str, str] = field(default_factory=dict)


class MemoryControlStore:
    """A job's control state in dicts; the same statuses as the Redis store's scripts."""

    def __init__(self, job: str, clock: Callable[[], float] = _wall_ms) -> None:
        self.job, self.clock = job, clock
        self._config: str | None = None
        self._spec: str | None = None
        self._leases: dict[str, float] = {}  # slot -> lease end (ms)
        self._slots: dict[str, _Slot] = {}
        self._ema: dict[str, str] = {}
        self._init_claim: tuple[str, float] | None = None
        self._slot_steps: dict[str, int] = {}
        self._finished: set[str] = set()
        self._finishing: dict[str, str] = {}
        self._stats: dict[str, float] = {}
        self._replicas: dict[str, tuple[float, str]] = {}  # replica -> (lease end, address)
        self._owners: dict[int, tuple[str, float]] = {}  # fragment -> ("replica epoch", end)
        self._epochs: dict[int, int] = {}
        self._rounds: dict[int, dict[str, str]] = {}
        self._orphans: dict[int, set[str]] = {}
        self._frags: dict[int, dict[str, str]] = {}
        self._seen: dict[tuple[int, str], dict[str, str]] = {}
        self._norms: dict[int, dict[str, str]] = {}
        self._logs: dict[int, list[str]] = {}
        self._fragment_stats: dict[int, dict[str, float]] = {}

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None

    def _bump(self, stats: dict[str, float], name: str, by: float) -> None:
        stats[name] = stats.get(name, 0.0) + by

    def _owner(self, fragment: int) -> str | None:
        held = self._owners.get(fragment)
        if held is None or held[1] <= self.clock():
            self._owners.pop(fragment, None)
            return None
        return held[0]

    # --- the job ----------------------------------------------------------------------------
    async def job_config(self, proposed: dict[str, Any]) -> dict[str, Any]:
        if self._config is None:
            self._config = json.dumps(proposed, sort_keys=True)
        return dict(json.loads(self._config))

    async def spec(self) -> str | None:
        return self._spec

    async def register_spec(self, spec_json: str) -> str:
        if self._spec is None:
            self._spec = spec_json
        return self._spec

    async def hello(
        self,
        spec_json: str,
        learner: str,
        incarnation: str,
        ttl_s: float,
        step: int,
        initialized: bool,
        pool: tuple[str, int] = ("", 0),
    ) -> Hello:
        now = self.clock()
        slot = self._slots.get(learner, _Slot())
        previous = slot.incarnation
        if self._leases.get(learner, -math.inf) > now and previous != incarnation:
            return Hello("busy", previous, False)
        prefix, cap = pool
        if prefix and cap > 0:
            held = sum(
                1
                for other, end in self._leases.items()
                if end > now and other != learner and other.startswith(prefix)
            )
            if held >= cap:
                return Hello("pool_full", previous, False)
        if self._spec is None:
            self._spec = spec_json
        if self._spec != spec_json:
            return Hello("spec_mismatch", self._spec, False)
        slot.incarnation, slot.joins = incarnation, slot.joins + 1
        slot.fields.update(joined_ms=str(now), updated_ms=str(now), step=str(step))
        self._slots[learner] = slot
        self._ema.pop(learner, None)
        self._leases[learner] = now + ttl_s * 1000
        counted = min(step, self._slot_steps.get(learner, 0))
        self._slot_steps[learner] = counted
        claimed = False
        if not initialized:
            if self._init_claim is None or self._init_claim[1] <= now:
                self._init_claim = (learner, now + INIT_CLAIM_S * 1000)
            claimed = self._init_claim[0] == learner
        return Hello("ok", previous, claimed, counted, sum(self._slot_steps.values()), slot.joins)

    async def heartbeat(
        self,
        learner: str,
        incarnation: str,
        session: int,
        ttl_s: float,
        counted: int,
        still_to_send: list[int] | None = None,
        **fields: float,
    ) -> int | None:
        slot = self._slots.get(learner)
        if slot is None or slot.incarnation != incarnation:
            return None
        if slot.joins != session:
            raise SessionReopened(learner)
        now = self.clock()
        slot.fields.update({k: repr(float(v)) for k, v in fields.items()}, updated_ms=str(now))
        if fields.get("ema", 0.0) > 0:
            self._ema[learner] = repr(float(fields["ema"]))
        self._leases[learner] = now + ttl_s * 1000
        self._slot_steps[learner] = counted
        if fields.get("last_sent", 0):
            self._finished.add(learner)
        else:
            self._finished.discard(learner)
        if still_to_send is not None:
            self._finishing[learner] = "".join(f",{p}" for p in still_to_send) + ","
        else:
            self._finishing.pop(learner, None)
        return sum(self._slot_steps.values())

    async def leave(self, learner: str, incarnation: str, session: int) -> None:
        slot = self._slots.get(learner)
        if slot is not None and slot.incarnation == incarnation and slot.joins == session:
            self._leases.pop(learner, None)

    async def live(self) -> Live:
        now = self.clock()
        learners = []
        for learner, end in sorted(self._leases.items(), key=lambda kv: (kv[1], kv[0])):
            if end < now:
                continue
            ema, still = self._ema.get(learner, ""), self._finishing.get(learner, "")
            learners.append(
                LiveLearner(
                    learner=learner,
                    step_time_ema_s=float(ema) if ema else 0.0,
                    finished=learner in self._finished,
                    still_to_send=(
                        frozenset(int(p) for p in still.strip(",").split(",") if p)
                        if still
                        else None
                    ),
                )
            )
        return Live(now_s=now / 1000.0, learners=tuple(learners))

    async def is_live(self, learner: str) -> bool:
        return self._leases.get(learner, -math.inf) > self.clock()

    async def add_stats(self, **increments: float) -> None:
        for name, value in increments.items():
            if value:
                self._bump(self._stats, name, value)

    async def stats(self, fragments: int) -> dict[str, float]:
        out = dict(self._stats)
        for p in range(fragments):
            for name, value in self._fragment_stats.get(p, {}).items():
                self._bump(out, name, value)
        return out

    # --- replicas and fragment owners -----------------------------------------------------
    async def register(self, replica: str, address: str, ttl_s: float) -> dict[str, str]:
        now = self.clock()
        if ttl_s == 0:
            self._replicas.pop(replica, None)
        else:
            self._replicas[replica] = (now + ttl_s * 1000, address)
        for gone in [r for r, (end, _) in self._replicas.items() if end < now]:
            del self._replicas[gone]
        return {r: address for r, (_, address) in sorted(self._replicas.items())}

    async def own(
        self, op: str, fragment: int, replica: str, epoch: int = 0, ttl_s: float = 0.0
    ) -> tuple[str, int]:
        held = self._owner(fragment)
        ttl_ms = max(1, int(ttl_s * 1000))
        if op == "acquire":
            if held is not None:
                return "taken", int(held.rsplit(" ", 1)[1])
            e = self._epochs.get(fragment, 0) + 1
            self._epochs[fragment] = e
            self._owners[fragment] = (f"{replica} {e}", self.clock() + ttl_ms)
            self._rounds.pop(fragment, None)
            orphans = self._orphans.pop(fragment, set())
            if orphans:
                stats = self._fragment_stats.setdefault(fragment, {})
                self._bump(stats, "updates_dropped", len(orphans))
            return "owned", e
        if held != f"{replica} {epoch}":
            return "lost", 0
        if op == "renew":
            self._owners[fragment] = (held, self.clock() + ttl_ms)
        else:
            del self._owners[fragment]
        return "owned", epoch

    async def owners(self, fragments: int) -> list[tuple[str, int] | None]:
        out: list[tuple[str, int] | None] = []
        for p in range(fragments):
            held = self._owner(p)
            if held is None:
                out.append(None)
            else:
                replica, epoch = held.rsplit(" ", 1)
                out.append((replica, int(epoch)))
        return out

    # --- fragment values (pointers into the tensor store) ---------------------------------
    async def versions(self, fragments: int) -> list[int | None]:
        return [
            int(self._frags[p]["version"]) if "version" in self._frags.get(p, {}) else None
            for p in range(fragments)
        ]

    async def is_initialized(self, fragments: int) -> bool:
        return fragments > 0 and None not in await self.versions(fragments)

    async def pointer(self, fragment: int) -> Pointer | None:
        fields = self._frags.get(fragment, {})
        if "version" not in fields:
            return None
        state = tuple(n for n in fields.get("state", "").split(",") if n)
        return Pointer(int(fields["version"]), fields["value"], state, fields.get("delta", ""))

    async def init_fragment(self, fragment: int, value: str, state: tuple[str, ...]) -> bool:
        if "version" in self._frags.get(fragment, {}):
            return False
        self._frags[fragment] = {
            "version": "0",
            "committed_ms": str(self.clock()),
            "value": value,
            "state": ",".join(state),
            "delta": "",
        }
        return True

    async def receive(
        self,
        fragment: int,
        replica: str,
        epoch: int,
        *,
        learner: str,
        incarnation: str,
        seq: int,
        checksum: int,
        base_version: int,
        max_staleness: int,
        record: dict[str, Any],
        generation: int | None = None,
        norm: tuple[float, int] | None = None,
    ) -> tuple[str, int]:
        fields = self._frags.get(fragment, {})
        if self._owner(fragment) != f"{replica} {epoch}":
            return "not_owner", int(fields.get("version", 0))
        if "version" not in fields:
            return "uninitialized", 0
        v = int(fields["version"])
        key = (fragment, learner)
        seen = self._seen.setdefault(key, {})
        holder = seen.get("incarnation")
        stats = self._fragment_stats.setdefault(fragment, {})
        if holder != incarnation:
            if generation is None:
                return "new_incarnation", v
            held = int(seen.get("generation", -1))
            if holder is not None and 0 < generation <= held:
                return "superseded", v
            if holder is not None:
                dropped = 0
                for name, entry in seen.items():
                    if name in ("incarnation", "generation"):
                        continue
                    was_epoch, _, state = entry.split(" ")
                    if state == "r" and int(was_epoch) < epoch:
                        dropped += 1
                    elif state == "r":
                        self._orphans.setdefault(fragment, set()).add(f"{learner}/{holder}/{name}")
                if dropped:
                    self._bump(stats, "updates_dropped", dropped)
            seen = self._seen[key] = {"incarnation": incarnation, "generation": str(generation)}
        digest = f"{checksum:016x}"
        before = seen.get(str(seq))
        if before is not None:
            was_epoch, was_sum, state = before.split(" ")
            if was_sum != digest:
                return "checksum", v
            if state == "c":
                return "duplicate", v
            if was_epoch == str(epoch):
                return "again", v
        if base_version > v:
            return "future", v
        if before is None and v - base_version > max_staleness:
            return "stale", v
        if before is None:
            self._bump(stats, "updates_accepted", 1)
        seen[str(seq)] = f"{epoch} {digest} r"
        self._rounds.setdefault(fragment, {})[f"{learner}/{incarnation}/{seq}"] = json.dumps(record)
        if norm is not None:
            self._norms.setdefault(fragment, {})[learner] = f"{norm[0]!r} {norm[1]}"
        return "received", v

    async def norms(self, fragment: int) -> dict[str, tuple[float, int]]:
        out: dict[str, tuple[float, int]] = {}
        for slot, entry in self._norms.get(fragment, {}).items():
            norm, steps = entry.split()
            out[slot] = (float(norm), int(steps))
        return out

    async def incarnation(self, learner: str) -> tuple[str, int] | None:
        slot = self._slots.get(learner)
        return None if slot is None else (slot.incarnation, slot.joins)

    async def commit(self, commit: Commit) -> tuple[str, int]:
        p = commit.fragment
        fields = self._frags.get(p, {})
        v = int(fields.get("version", -1))
        numbers = (commit.useful_seconds, commit.tokens_merged, commit.stale_folded)
        if not all(math.isfinite(x) for x in numbers):
            return "bad_args", v
        if self._owner(p) != f"{commit.replica} {commit.epoch}":
            return "lost_lease", v
        if v != commit.expected_version:
            return "version_moved", v
        v += 1
        fields.update(
            version=str(v),
            committed_ms=str(self.clock()),
            value=commit.value,
            state=",".join(commit.state),
            delta=commit.delta,
        )
        self._frags[p] = fields
        for learner, incarnation, seq in commit.merged:
            uid = f"{learner}/{incarnation}/{seq}"
            self._rounds.get(p, {}).pop(uid, None)
            seen = self._seen.get((p, learner), {})
            if seen.get("incarnation") == incarnation:
                if str(seq) in seen:
                    seen[str(seq)] = seen[str(seq)][:-1] + "c"
            else:
                self._orphans.get(p, set()).discard(uid)
        stats = self._fragment_stats.setdefault(p, {})
        self._bump(stats, "useful_seconds", commit.useful_seconds)
        self._bump(stats, "tokens_merged", commit.tokens_merged)
        self._bump(stats, "stale_folded", commit.stale_folded)
        self._bump(stats, "versions_committed", 1)
        log = self._logs.setdefault(p, [])
        log.append(json.dumps(commit.log_entry))
        del log[:-LOG_KEEP]
        return "committed", v

    async def log_range(self, fragment: int, after: int, upto: int) -> list[dict[str, Any]]:
        entries = [json.loads(e) for e in self._logs.get(fragment, [])]
        return [e for e in entries if after < int(e["version"]) <= upto]

    async def pending(self, fragments: int) -> list[str]:
        return sorted(uid for p in range(fragments) for uid in self._rounds.get(p, {}))
