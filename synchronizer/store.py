"""Where the synchronizer's state lives: the store interface and its Redis implementation.

Every key of a job shares the `{job}` hash tag (Redis Cluster safe), and every
check-and-set is one Lua script (see `lua/`), so any replica may act on any fragment.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol
from urllib.parse import urlparse

import numpy as np
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from services.config import INIT_CLAIM_S
from synchronizer.rounds import RoundState

SUPPORTED_SCHEMES = ("redis", "rediss", "unix")
STAGE_TTL_S = 86_400  # payloads and staged values that no script adopts expire
DELTA_TTL_S = 300  # a learner further behind than this gets a full copy


class StoreError(RuntimeError):
    """The store refused or could not do what was asked; the message says why."""


@dataclass(frozen=True)
class Hello:
    ok: bool  # False: the learner's model spec differs from the job's
    previous: str  # the incarnation this one replaces ("" if none)
    initializer: bool  # the job has no parameters yet and this learner is to send them


@dataclass(frozen=True)
class SubmitResult:
    status: str  # accepted | duplicate | uninitialized | future | stale
    version: int
    contributors: int


@dataclass(frozen=True)
class PendingUpdate:
    uid: str
    meta: dict[str, Any]
    payload: bytes


@dataclass(frozen=True)
class FragmentState:
    version: int
    theta: np.ndarray
    opt_state: list[np.ndarray]


@dataclass(frozen=True)
class Commit:
    """A merged round, ready to be committed under the merge lease."""

    fragment: int
    token: int
    expected_version: int
    theta: np.ndarray
    opt_state: list[np.ndarray]
    uids: list[str]
    useful_seconds: float
    tokens_merged: float
    stale_folded: int
    t_sync_s: float
    log_entry: dict[str, Any]
    delta: bytes = b""  # the encoded delta from expected_version to the new version


class Store(Protocol):
    """What the synchronizer needs of its state backend (Redis is the implementation)."""

    async def ping(self) -> bool: ...
    async def close(self) -> None: ...
    async def job_config(self, proposed: dict[str, Any]) -> dict[str, Any]: ...
    async def spec(self) -> str | None: ...
    async def register_spec(self, spec_json: str) -> str: ...
    async def hello(
        self, spec_json: str, learner: str, incarnation: str, ttl_s: float, step: int
    ) -> Hello: ...
    async def heartbeat(
        self,
        learner: str,
        incarnation: str,
        ttl_s: float,
        still_to_send: list[int] | None = None,
        **fields: float,
    ) -> int | None: ...
    async def leave(self, learner: str, incarnation: str) -> None: ...
    async def is_initialized(self) -> bool: ...
    async def initialize(
        self, thetas: list[np.ndarray], opt_states: list[list[np.ndarray]]
    ) -> bool: ...
    async def versions(self, fragments: int) -> list[int]: ...
    async def fragment(self, index: int) -> FragmentState: ...
    async def global_value(self, index: int) -> tuple[int, bytes]: ...
    async def submit(
        self,
        fragment: int,
        uid: str,
        learner: str,
        seq: int,
        base_version: int,
        max_staleness: int,
        payload: bytes,
        meta: dict[str, Any],
    ) -> SubmitResult: ...
    async def round_state(self, fragment: int) -> tuple[RoundState, float, float]: ...
    async def mark_quorum(self, fragment: int, grace_s: float) -> None: ...
    async def acquire_merge_lease(self, fragment: int, ttl_s: float) -> int: ...
    async def release_merge_lease(self, fragment: int, token: int) -> None: ...
    async def renew_merge_lease(self, fragment: int, token: int, ttl_s: float) -> bool: ...
    async def pending(self, fragment: int) -> list[PendingUpdate]: ...
    async def commit(self, commit: Commit) -> tuple[str, int]: ...
    async def delta(self, fragment: int, version: int) -> bytes | None: ...
    async def add_stats(self, **increments: float) -> None: ...
    async def subscribe_commits(self) -> Any: ...


def job_key(job: str, *parts: object) -> str:
    """The Redis key of a job's state: `atoll:{job}:a:b`. The `{job}` hash tag keeps a job in
    one Redis Cluster slot. Everything that reads a job's state builds keys here."""
    return f"atoll:{{{job}}}:" + ":".join(str(p) for p in parts)


def select_round(metas: dict[str, dict[str, Any]]) -> list[str]:
    """The uids one round merges: each learner's oldest pending update (by base version,
    then seq). A learner's later updates wait for the next rounds, so a round's cost is
    bounded by the number of learners, whatever the backlog."""
    oldest: dict[str, tuple[int, int, str]] = {}
    for uid, meta in metas.items():
        rank = (int(meta["base_version"]), int(meta["seq"]), uid)
        learner = str(meta["learner"])
        if learner not in oldest or rank < oldest[learner]:
            oldest[learner] = rank
    return sorted(rank[2] for rank in oldest.values())


def _b(value: object) -> bytes:
    """A Redis reply as bytes (the client runs with decode_responses=False)."""
    if not isinstance(value, bytes):
        raise StoreError(f"unexpected reply from Redis: {value!r}")
    return value


def _pack(arrays: list[np.ndarray]) -> bytes:
    return b"".join(np.ascontiguousarray(a, "<f4").tobytes() for a in arrays)


def _unpack(blob: bytes, size: int) -> list[np.ndarray]:
    flat = np.frombuffer(blob, "<f4")
    return [flat[i : i + size].copy() for i in range(0, flat.size, size)] if size else []


class RedisStore:
    """The real store: one Redis (or a Redis Cluster slot, through the `{job}` hash tag)."""

    def __init__(self, client: aioredis.Redis, job: str) -> None:
        self._r = client
        self._job = job
        lua = resources.files("synchronizer") / "lua"
        self._scripts: dict[str, AsyncScript] = {
            path.name.removesuffix(".lua"): client.register_script(path.read_text())
            for path in lua.iterdir()
            if path.name.endswith(".lua")
        }

    def key(self, *parts: object) -> str:
        return job_key(self._job, *parts)

    async def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        return await self._scripts[script](keys=keys, args=args)

    async def spec(self) -> str | None:
        """The job's parameter spec (JSON), if a learner or checkpoint has set it."""
        stored = await self._r.get(self.key("spec"))
        return None if stored is None else _b(stored).decode()

    async def ping(self) -> bool:
        return bool(await self._r.ping())

    async def close(self) -> None:
        await self._r.aclose()

    async def job_config(self, proposed: dict[str, Any]) -> dict[str, Any]:
        """The job's config: set by the first replica, then the same for every replica."""
        encoded = json.dumps(proposed, sort_keys=True)
        await self._r.set(self.key("config"), encoded, nx=True)
        stored = await self._r.get(self.key("config"))
        return dict(json.loads(_b(stored)))

    async def hello(
        self, spec_json: str, learner: str, incarnation: str, ttl_s: float, step: int
    ) -> Hello:
        reply = await self._run(
            "hello",
            [
                self.key("spec"),
                self.key("learners"),
                self.key("learner", learner),
                self.key("ema"),
                self.key("init"),
                self.key("init_claim"),
            ],
            [spec_json, learner, incarnation, int(ttl_s * 1000), step, int(INIT_CLAIM_S * 1000)],
        )
        status, detail = _b(reply[0]), _b(reply[1]).decode()
        if status != b"ok":
            return Hello(False, "", False)
        return Hello(True, detail, bool(int(reply[2])))

    async def heartbeat(
        self,
        learner: str,
        incarnation: str,
        ttl_s: float,
        still_to_send: list[int] | None = None,
        **fields: float,
    ) -> int | None:
        """Renew the lease; return the job's steps over all slots, None if not renewed.
        `still_to_send`: finishing, with these fragments' updates still to come (None: not)."""
        args = [learner, incarnation, int(ttl_s * 1000)]
        args += [repr(float(fields[k])) for k in ("step", "ema", "tokens_s", "loss", "eval_loss")]
        args.append(int(fields.get("done", 0)))
        args.append(int(fields.get("last_sent", 0)))
        args.append(
            "".join(f",{p}" for p in still_to_send) + "," if still_to_send is not None else ""
        )
        keys = [
            self.key("learners"),
            self.key("learner", learner),
            self.key("ema"),
            self.key("slot_steps"),
            self.key("finished"),
            self.key("finishing"),
        ]
        total = int(await self._run("heartbeat", keys, args))
        return None if total < 0 else total

    async def leave(self, learner: str, incarnation: str) -> None:
        await self._run(
            "leave", [self.key("learners"), self.key("learner", learner)], [learner, incarnation]
        )

    async def is_initialized(self) -> bool:
        return bool(await self._r.exists(self.key("init")))

    async def initialize(
        self, thetas: list[np.ndarray], opt_states: list[list[np.ndarray]]
    ) -> bool:
        p = len(thetas)
        stage = uuid.uuid4().hex
        kinds: list[list[str]] = [[], [], [], [], [], []]
        async with self._r.pipeline(transaction=False) as pipe:
            for i in range(p):
                kinds[0].append(self.key("frag", i))
                kinds[1].append(self.key("round", i))
                kinds[2].append(self.key("theta", i))
                kinds[3].append(self.key("opt", i))
                kinds[4].append(self.key("stage", i, stage, "theta"))
                kinds[5].append(self.key("stage", i, stage, "opt"))
                pipe.set(kinds[4][-1], _pack([thetas[i]]), ex=STAGE_TTL_S)
                pipe.set(kinds[5][-1], _pack(opt_states[i]), ex=STAGE_TTL_S)
            keys = [self.key("init")] + [k for kind in kinds for k in kind]
            await self._scripts["init"](keys=keys, args=[p], client=pipe)
            replies = await pipe.execute()
        return bool(replies[-1])

    async def versions(self, fragments: int) -> list[int]:
        async with self._r.pipeline(transaction=False) as pipe:
            for i in range(fragments):
                pipe.hget(self.key("frag", i), "version")
            raw = await pipe.execute()
        return [int(v) if v is not None else 0 for v in raw]

    async def _read_fragment(self, index: int, with_opt: bool) -> tuple[int, bytes, bytes]:
        async with self._r.pipeline(transaction=True) as pipe:  # one consistent snapshot
            pipe.hget(self.key("frag", index), "version")
            pipe.get(self.key("theta", index))
            if with_opt:
                pipe.get(self.key("opt", index))
            replies = await pipe.execute()
        if replies[0] is None or replies[1] is None:
            raise StoreError(
                f"fragment {index} has no global value yet: the job is not initialized"
            )
        return int(replies[0]), _b(replies[1]), _b(replies[2]) if with_opt else b""

    async def fragment(self, index: int) -> FragmentState:
        version, theta, opt = await self._read_fragment(index, with_opt=True)
        flat = np.frombuffer(theta, "<f4").copy()
        return FragmentState(version, flat, _unpack(opt, flat.size))

    async def global_value(self, index: int) -> tuple[int, bytes]:
        version, theta, _ = await self._read_fragment(index, with_opt=False)
        return version, theta

    async def submit(
        self,
        fragment: int,
        uid: str,
        learner: str,
        seq: int,
        base_version: int,
        max_staleness: int,
        payload: bytes,
        meta: dict[str, Any],
    ) -> SubmitResult:
        payload_key = self.key("payload", fragment, uid)
        keys = [
            self.key("frag", fragment),
            self.key("pmeta", fragment),
            self.key("contrib", fragment),
            self.key("seen", learner, meta["incarnation"]),
            self.key("stats"),
            payload_key,
        ]
        args: list[Any] = [uid, learner, seq, base_version, max_staleness, json.dumps(meta)]
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.set(payload_key, payload, ex=STAGE_TTL_S)
            await self._scripts["submit"](keys=keys, args=args, client=pipe)
            _, (status, version, contributors) = await pipe.execute()
        return SubmitResult(_b(status).decode(), int(version), int(contributors))

    async def round_state(self, fragment: int) -> tuple[RoundState, float, float]:
        """The round's state, the slowest live learner's step-time EMA and the t_sync EMA."""
        keys = [
            self.key("round", fragment),
            self.key("contrib", fragment),
            self.key("learners"),
            self.key("ema"),
            self.key("stats"),
            self.key("finished"),
            self.key("finishing"),
        ]
        reply = await self._run("round_state", keys, [fragment])
        now, opened, quorum, deadline, contrib, live, slowest, t_sync, finished, waiting = reply
        ms = 1000.0
        state = RoundState(
            contributors=int(contrib),
            live_learners=int(live),
            finished_learners=int(finished),
            waiting=int(waiting),
            opened_at=float(opened) / ms,
            quorum_at=float(quorum) / ms if quorum else None,
            deadline=float(deadline) / ms if deadline else None,
            now=float(now) / ms,
        )
        return state, float(slowest), float(t_sync)

    async def mark_quorum(self, fragment: int, grace_s: float) -> None:
        await self._run("quorum", [self.key("round", fragment)], [int(grace_s * 1000)])

    async def acquire_merge_lease(self, fragment: int, ttl_s: float) -> int:
        keys = [self.key("lease", fragment), self.key("fence")]
        return int(await self._run("lease", keys, [max(1, int(ttl_s * 1000))]))

    async def release_merge_lease(self, fragment: int, token: int) -> None:
        await self._run("release", [self.key("lease", fragment)], [token])

    async def renew_merge_lease(self, fragment: int, token: int, ttl_s: float) -> bool:
        reply = await self._run(
            "renew", [self.key("lease", fragment)], [token, max(1, int(ttl_s * 1000))]
        )
        return bool(reply)

    async def register_spec(self, spec_json: str) -> str:
        """Set the job's parameter spec if none is set yet; return the job's spec."""
        await self._r.set(self.key("spec"), spec_json, nx=True)
        return _b(await self._r.get(self.key("spec"))).decode()

    async def pending(self, fragment: int) -> list[PendingUpdate]:
        """The updates of the open round: the oldest pending update of each learner."""
        metas = {
            _b(uid).decode(): json.loads(meta)
            for uid, meta in (await self._r.hgetall(self.key("pmeta", fragment))).items()
        }
        uids = select_round(metas)
        if not uids:
            return []
        payloads = await self._r.mget([self.key("payload", fragment, u) for u in uids])
        return [
            PendingUpdate(uid, metas[uid], _b(payload))
            for uid, payload in zip(uids, payloads, strict=True)
            if payload is not None
        ]

    async def commit(self, commit: Commit) -> tuple[str, int]:
        p = commit.fragment
        stage_theta = self.key("stage", p, commit.token, "theta")
        stage_opt = self.key("stage", p, commit.token, "opt")
        stage_delta = self.key("stage", p, commit.token, "delta")
        keys = [
            self.key("frag", p),
            self.key("pmeta", p),
            self.key("contrib", p),
            self.key("round", p),
            self.key("lease", p),
            self.key("log", p),
            self.key("stats"),
            self.key("theta", p),
            self.key("opt", p),
            stage_theta,
            stage_opt,
            stage_delta,
            self.key("delta", p, commit.expected_version + 1),
            *(self.key("payload", p, uid) for uid in commit.uids),
        ]
        args: list[Any] = [
            commit.token,
            commit.expected_version,
            len(commit.uids),
            *commit.uids,
            repr(commit.useful_seconds),
            repr(commit.tokens_merged),
            commit.stale_folded,
            repr(commit.t_sync_s),
            json.dumps(commit.log_entry),
            self.commits_channel(),
            p,
            DELTA_TTL_S,
        ]
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.set(stage_theta, _pack([commit.theta]), ex=STAGE_TTL_S)
            pipe.set(stage_opt, _pack(commit.opt_state), ex=STAGE_TTL_S)
            pipe.set(stage_delta, commit.delta, ex=STAGE_TTL_S)
            await self._scripts["commit"](keys=keys, args=args, client=pipe)
            *_, (status, version) = await pipe.execute()
        return _b(status).decode(), int(version)

    async def delta(self, fragment: int, version: int) -> bytes | None:
        """The encoded delta that made `version` of a fragment, while it is kept."""
        value = await self._r.get(self.key("delta", fragment, version))
        return None if value is None else _b(value)

    async def add_stats(self, **increments: float) -> None:
        async with self._r.pipeline(transaction=False) as pipe:
            for name, value in increments.items():
                if value:
                    pipe.hincrbyfloat(self.key("stats"), name, value)
            await pipe.execute()

    def commits_channel(self) -> str:
        return self.key("commits")

    async def subscribe_commits(self) -> Any:
        pubsub = self._r.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.commits_channel())
        return pubsub


def open_store(url: str, job: str) -> Store:
    """The store named by `url`; only Redis is implemented (`redis://`, `rediss://`, `unix://`)."""
    scheme = urlparse(url).scheme
    if scheme not in SUPPORTED_SCHEMES:
        raise StoreError(
            f"unsupported store URL {url!r}: use redis://HOST:PORT/DB, rediss://... or "
            "unix:///path/to/redis.sock"
        )
    client = aioredis.Redis.from_url(
        url,
        decode_responses=False,
        socket_timeout=10,
        socket_connect_timeout=5,
        health_check_interval=5,
    )
    return RedisStore(client, job)
