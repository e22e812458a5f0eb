"""The control store's interface: what the synchronizer records and reads of a job's control
state, and the records it speaks in. `redis_store.RedisControlStore` is the real one;
`memory_store.MemoryControlStore` keeps the same rules in a dict, for unit tests.

Every method is one atomic step (in Redis, one Lua script or one read): a check-and-set
returns a status, and what to do about it is decided by the caller (`core/rounds.py`, the
owner). Statuses are named in each method's docstring and in `lua/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from synchronizer.core.rounds import Live

LOG_KEEP = 2000  # commit log entries kept per fragment (older ones are in the tape)


class StoreError(RuntimeError):
    """The store refused or could not do what was asked; the message says why."""


@dataclass(frozen=True)
class Hello:
    status: str  # ok, spec_mismatch (the learner's model differs), busy (slot has a session)
    previous: str  # the incarnation this one replaces ("" if none)
    initializer: bool  # the job has no parameters yet and this learner is to send them
    counted_steps: int = 0  # the slot's steps toward the job's budget, as counted now
    steps_done: int = 0  # the job's steps over all slots, as counted now
    session: int = 0  # the slot's count of hellos: this session's number


class SessionReopened(Exception):
    """The learner's incarnation opened a newer session (it reconnected): this one ends."""


@dataclass(frozen=True)
class Pointer:
    """Where a fragment's committed version lives in the tensor store."""

    version: int
    value: str
    state: tuple[str, ...]
    delta: str  # the encoded delta that made this version ('' for version 0)


@dataclass(frozen=True)
class Commit:
    """A merged round, ready to be committed by the fragment's owner."""

    fragment: int
    replica: str
    epoch: int
    expected_version: int
    value: str
    state: tuple[str, ...]
    delta: str
    merged: list[tuple[str, str, int]]  # (learner, incarnation, seq) of each merged update
    useful_seconds: float
    tokens_merged: float
    stale_folded: int
    log_entry: dict[str, Any]


class ControlStore(Protocol):
    """A job's control state: learners' sessions, replicas, fragment owners, pointers to the
    committed values, round membership, idempotency records, counters and the commit log."""

    @property
    def job(self) -> str: ...

    async def ping(self) -> bool: ...
    async def close(self) -> None: ...

    # --- the job ----------------------------------------------------------------------------
    async def job_config(self, proposed: dict[str, Any]) -> dict[str, Any]:
        """The job's config: set by the first replica, then the same for every replica."""
        ...

    async def spec(self) -> str | None: ...

    async def register_spec(self, spec_json: str) -> str:
        """Set the job's parameter spec if none is set yet; return the job's spec."""
        ...

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
        """A learner's hello (`lua/hello.lua`): ok, spec_mismatch, busy or pool_full. A hello of
        the live session's own incarnation opens a new session (it reconnected)."""
        ...

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
        """Renew the lease; return the job's steps over all slots, None if not renewed (a
        newer incarnation holds the slot). Raises SessionReopened when this incarnation
        opened a newer session."""
        ...

    async def leave(self, learner: str, incarnation: str, session: int) -> None:
        """Drop the lease if it is still this session's."""
        ...

    async def live(self) -> Live:
        """The live learners, at one instant of the store's clock."""
        ...

    async def is_live(self, learner: str) -> bool:
        """Whether the slot holds a live session now."""
        ...

    async def add_stats(self, **increments: float) -> None: ...
    async def stats(self, fragments: int) -> dict[str, float]: ...

    # --- replicas and fragment owners -----------------------------------------------------
    async def register(self, replica: str, address: str, ttl_s: float) -> dict[str, str]:
        """Say this replica is alive (ttl 0: leaving); return live replica -> address."""
        ...

    async def own(
        self, op: str, fragment: int, replica: str, epoch: int = 0, ttl_s: float = 0.0
    ) -> tuple[str, int]:
        """Acquire, renew or release a fragment's ownership: (owned | taken | lost, epoch)."""
        ...

    async def owners(self, fragments: int) -> list[tuple[str, int] | None]: ...

    # --- fragment values (pointers into the tensor store) ---------------------------------
    async def versions(self, fragments: int) -> list[int | None]: ...
    async def is_initialized(self, fragments: int) -> bool: ...
    async def pointer(self, fragment: int) -> Pointer | None: ...
    async def init_fragment(self, fragment: int, value: str, state: tuple[str, ...]) -> bool: ...

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
        """Record a received update (`lua/receive.lua`): (status, version)."""
        ...

    async def norms(self, fragment: int) -> dict[str, tuple[float, int]]: ...
    async def incarnation(self, learner: str) -> tuple[str, int] | None: ...

    async def commit(self, commit: Commit) -> tuple[str, int]:
        """Commit a merged round (`lua/commit.lua`): (committed | lost_lease | version_moved
        | bad_args, version)."""
        ...

    async def log_range(self, fragment: int, after: int, upto: int) -> list[dict[str, Any]]: ...
    async def pending(self, fragments: int) -> list[str]: ...
