"""The control store in Redis: small records only (no tensor bytes, no value over about 1 MiB).

Every check-and-set is one Lua script (see `lua/`) over keys of one hash tag: a fragment's
scripts touch only that fragment's keys, the job's scripts only job-wide keys, so a Redis
Cluster may hold them on different nodes. Scripts return statuses; what to do about them is
decided in Python (`core/rounds.py`, the owner). The interface it keeps is
`control.ControlStore`.
"""

from __future__ import annotations

import json
import math
import os
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, parse_qsl, urlparse, urlunparse

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.commands.core import AsyncScript

from services.config import INIT_CLAIM_S
from synchronizer.core.rounds import Live, LiveLearner
from synchronizer.store.control import LOG_KEEP, Commit, Hello, Pointer, SessionReopened, StoreError
from synchronizer.store.keys import JobKeys

SUPPORTED_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel")
SEEN_TTL_S = 7 * 86_400  # a slot's idempotency records of a fragment it stopped sending to


SECRET_QUERY_KEYS = ("password", "passwd", "pass", "token", "secret", "key", "sig", "signature")


def redact(url: str) -> str:
    """A URL (Redis, tensor store) with its password and secret query values replaced, fit
    for logs and errors."""
    try:
        parts = urlparse(url)
        password = parts.password
    except ValueError:
        return "<unparsable URL>"
    if password is not None:
        parts = parts._replace(netloc=parts.netloc.replace(f":{password}@", ":***@"))
    if parts.query:
        query = [
            (k, "***" if any(s in k.lower() for s in SECRET_QUERY_KEYS) else v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        ]
        parts = parts._replace(query="&".join(f"{k}={v}" for k, v in query))
    return urlunparse(parts)


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _password_from_env() -> str | None:
    path = os.environ.get("ATOLL_REDIS_PASSWORD_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get("ATOLL_REDIS_PASSWORD") or None


def open_redis(url: str) -> Any:
    """A client for `url`: one Redis (`redis://`, `rediss://`, `unix://`), a Redis Cluster
    (`redis+cluster://HOST:PORT`, any node), or the master a Sentinel names
    (`redis+sentinel://HOST:PORT/SERVICE`). The password may come from the URL, or better from
    `ATOLL_REDIS_PASSWORD_FILE` (or `ATOLL_REDIS_PASSWORD`), so it never shows in a URL."""
    scheme = urlparse(url).scheme
    if scheme not in SUPPORTED_SCHEMES:
        raise StoreError(
            f"unsupported Redis URL {redact(url)!r}: use redis://HOST:PORT/DB, rediss://..., "
            "unix:///path/to/redis.sock, redis+cluster://HOST:PORT or "
            "redis+sentinel://HOST:PORT/SERVICE"
        )
    options: dict[str, Any] = {
        "decode_responses": False,
        "socket_timeout": 10,
        "socket_connect_timeout": 5,
    }
    password = _password_from_env()
    if password is not None:
        options["password"] = password
    if scheme.endswith("+cluster"):
        plain = url.replace("+cluster", "", 1)
        return RedisCluster.from_url(plain, **options)
    if scheme == "redis+sentinel":
        parts = urlparse(url)
        service = parts.path.strip("/") or "mymaster"
        hosts = [(h.rsplit(":", 1)[0], int(h.rsplit(":", 1)[1])) for h in parts.netloc.split(",")]
        query = parse_qs(parts.query)
        sentinel = Sentinel(hosts, **options)  # type: ignore[no-untyped-call]
        if "db" in query:
            options["db"] = int(query["db"][0])
        return sentinel.master_for(service, **options)
    return aioredis.Redis.from_url(url, health_check_interval=5, **options)


class RedisControlStore:
    """A job's control state in Redis (one server, a Cluster, or a Sentinel's master)."""

    def __init__(self, client: Any, job: str) -> None:
        self.redis = client
        self.job = job
        self.keys = JobKeys(job)
        lua = resources.files("synchronizer.store") / "lua"
        self._scripts: dict[str, AsyncScript] = {
            path.name.removesuffix(".lua"): client.register_script(path.read_text())
            for path in lua.iterdir()
            if path.name.endswith(".lua")
        }

    async def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        return await self._scripts[script](keys=keys, args=args)

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def close(self) -> None:
        await self.redis.aclose()

    # --- the job ----------------------------------------------------------------------------
    async def job_config(self, proposed: dict[str, Any]) -> dict[str, Any]:
        """The job's config: set by the first replica, then the same for every replica."""
        await self.redis.set(self.keys.config, json.dumps(proposed, sort_keys=True), nx=True)
        return dict(json.loads(_s(await self.redis.get(self.keys.config))))

    async def spec(self) -> str | None:
        stored = await self.redis.get(self.keys.spec)
        return None if stored is None else _s(stored)

    async def register_spec(self, spec_json: str) -> str:
        """Set the job's parameter spec if none is set yet; return the job's spec."""
        await self.redis.set(self.keys.spec, spec_json, nx=True)
        return _s(await self.redis.get(self.keys.spec))

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
        """A learner's hello (`lua/hello.lua`). `pool`: the slot prefix its credential names
        and the most sessions that credential may hold at once (0: no cap)."""
        k = self.keys
        reply = await self._run(
            "hello",
            [k.spec, k.learners, k.learner(learner), k.ema, k.init_claim, k.slot_steps],
            [
                spec_json,
                learner,
                incarnation,
                int(ttl_s * 1000),
                step,
                int(INIT_CLAIM_S * 1000),
                int(initialized),
                pool[0],
                pool[1],
            ],
        )
        if _s(reply[0]) != "ok":
            return Hello(_s(reply[0]), "", False)
        return Hello(
            "ok", _s(reply[1]), bool(int(reply[2])), int(reply[3]), int(reply[4]), int(reply[5])
        )

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
        opened a newer session.
        `still_to_send`: finishing, with these fragments' updates still to come (None: not);
        `counted`: the slot's steps toward the budget (its claimed `step`, bounded)."""
        args: list[Any] = [learner, incarnation, int(ttl_s * 1000)]
        args += [repr(float(fields[k])) for k in ("step", "ema", "tokens_s", "loss", "eval_loss")]
        args.append(int(fields.get("done", 0)))
        args.append(int(fields.get("last_sent", 0)))
        args.append(
            "".join(f",{p}" for p in still_to_send) + "," if still_to_send is not None else ""
        )
        args.append(counted)
        args.append(session)
        k = self.keys
        keys = [k.learners, k.learner(learner), k.ema, k.slot_steps, k.finished, k.finishing]
        total = int(await self._run("heartbeat", keys, args))
        if total == -2:
            raise SessionReopened(learner)
        return None if total < 0 else total

    async def leave(self, learner: str, incarnation: str, session: int) -> None:
        await self._run(
            "leave",
            [self.keys.learners, self.keys.learner(learner)],
            [learner, incarnation, session],
        )

    async def live(self) -> Live:
        """The live learners, at one instant of Redis time."""
        k = self.keys
        reply = await self._run("live", [k.learners, k.ema, k.finished, k.finishing], [])
        learners = []
        for i in range(1, len(reply), 4):
            ema, still = _s(reply[i + 1]), _s(reply[i + 3])
            learners.append(
                LiveLearner(
                    learner=_s(reply[i]),
                    step_time_ema_s=float(ema) if ema else 0.0,
                    finished=bool(int(reply[i + 2])),
                    still_to_send=(
                        frozenset(int(p) for p in still.strip(",").split(",") if p)
                        if still
                        else None
                    ),
                )
            )
        return Live(now_s=float(reply[0]) / 1000.0, learners=tuple(learners))

    async def is_live(self, learner: str) -> bool:
        """Whether the slot holds a live session now (its lease runs, in Redis time)."""
        return bool(int(await self._run("lease", [self.keys.learners], [learner])))

    async def add_stats(self, **increments: float) -> None:
        """Add to the job-wide counters (bytes, rejections)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for name, value in increments.items():
                if value:
                    pipe.hincrbyfloat(self.keys.stats, name, value)
            await pipe.execute()

    async def stats(self, fragments: int) -> dict[str, float]:
        """The job's counters: job-wide ones plus every fragment's, summed."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.stats)
            for p in range(fragments):
                pipe.hgetall(self.keys.fragment_stats(p))
            replies = await pipe.execute()
        out: dict[str, float] = {}
        for reply in replies:
            for name, value in reply.items():
                out[_s(name)] = out.get(_s(name), 0.0) + float(value)
        return out

    # --- replicas and fragment owners -----------------------------------------------------
    async def register(self, replica: str, address: str, ttl_s: float) -> dict[str, str]:
        """Say this replica is alive (ttl 0: leaving); return live replica -> address."""
        reply = await self._run(
            "register",
            [self.keys.replicas, self.keys.replica("addresses")],
            [replica, address, int(ttl_s * 1000)],
        )
        return {_s(reply[i]): _s(reply[i + 1]) for i in range(0, len(reply), 2)}

    async def own(
        self, op: str, fragment: int, replica: str, epoch: int = 0, ttl_s: float = 0.0
    ) -> tuple[str, int]:
        """Acquire, renew or release a fragment's ownership; return (status, epoch)."""
        k = self.keys
        reply = await self._run(
            "own",
            [
                k.owner(fragment),
                k.epoch(fragment),
                k.round(fragment),
                k.orphans(fragment),
                k.fragment_stats(fragment),
            ],
            [op, replica, epoch, max(1, int(ttl_s * 1000))],
        )
        return _s(reply[0]), int(reply[1])

    async def owners(self, fragments: int) -> list[tuple[str, int] | None]:
        """Each fragment's owner (replica, epoch), None where no one owns it now."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for p in range(fragments):
                pipe.get(self.keys.owner(p))
            replies = await pipe.execute()
        out: list[tuple[str, int] | None] = []
        for reply in replies:
            if reply is None:
                out.append(None)
            else:
                replica, epoch = _s(reply).rsplit(" ", 1)
                out.append((replica, int(epoch)))
        return out

    # --- fragment values (pointers into the tensor store) ---------------------------------
    async def versions(self, fragments: int) -> list[int | None]:
        """Each fragment's committed version; None where it has no value yet."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for p in range(fragments):
                pipe.hget(self.keys.frag(p), "version")
            raw = await pipe.execute()
        return [int(v) if v is not None else None for v in raw]

    async def is_initialized(self, fragments: int) -> bool:
        return fragments > 0 and None not in await self.versions(fragments)

    async def pointer(self, fragment: int) -> Pointer | None:
        raw = await self.redis.hgetall(self.keys.frag(fragment))
        fields = {_s(k): _s(v) for k, v in raw.items()}
        if "version" not in fields:
            return None
        state = tuple(n for n in fields.get("state", "").split(",") if n)
        return Pointer(int(fields["version"]), fields["value"], state, fields.get("delta", ""))

    async def init_fragment(self, fragment: int, value: str, state: tuple[str, ...]) -> bool:
        reply = await self._run(
            "init_fragment", [self.keys.frag(fragment)], [value, ",".join(state)]
        )
        return bool(int(reply))

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
        """Record a received update (`lua/receive.lua`). `generation`: the slot's count of
        hellos when `incarnation` was read to be its current one; None: not read yet (the
        status is `new_incarnation` if the slot's records here are another's). `norm`: its
        L2 norm as it merges and its inner steps, the slot's entry in the fragment's norm
        history if it is received (None: none)."""
        k = self.keys
        reply = await self._run(
            "receive",
            [
                k.frag(fragment),
                k.owner(fragment),
                k.round(fragment),
                k.seen(fragment, learner),
                k.fragment_stats(fragment),
                k.orphans(fragment),
                k.norms(fragment),
            ],
            [
                replica,
                epoch,
                f"{learner}/{incarnation}/{seq}",
                seq,
                f"{checksum:016x}",
                base_version,
                max_staleness,
                json.dumps(record),
                incarnation,
                "" if generation is None else generation,
                SEEN_TTL_S,
                learner,
                "" if norm is None else f"{norm[0]!r} {norm[1]}",
            ],
        )
        return _s(reply[0]), int(reply[1])

    async def norms(self, fragment: int) -> dict[str, tuple[float, int]]:
        """Each slot's last accepted update's norm (as merged) and inner steps on the
        fragment; an entry that does not parse as a finite norm >= 0 is left out."""
        out: dict[str, tuple[float, int]] = {}
        for slot, entry in (await self.redis.hgetall(self.keys.norms(fragment))).items():
            try:
                norm, steps = _s(entry).split()
                value, count = float(norm), int(steps)
            except ValueError:
                continue
            if math.isfinite(value) and value >= 0 and count >= 0:
                out[_s(slot)] = (value, count)
        return out

    async def incarnation(self, learner: str) -> tuple[str, int] | None:
        """A slot's current incarnation and generation (its count of hellos); None if it
        never said hello."""
        incarnation, joins = await self.redis.hmget(
            self.keys.learner(learner), "incarnation", "joins"
        )
        if incarnation is None:
            return None
        return _s(incarnation), int(joins or 0)

    async def commit(self, commit: Commit) -> tuple[str, int]:
        k = self.keys
        p = commit.fragment
        triples: list[Any] = []
        for learner, incarnation, seq in commit.merged:
            triples += [f"{learner}/{incarnation}/{seq}", seq, incarnation]
        reply = await self._run(
            "commit",
            [
                k.frag(p),
                k.owner(p),
                k.round(p),
                k.log(p),
                k.fragment_stats(p),
                k.orphans(p),
                *(k.seen(p, learner) for learner, _, _ in commit.merged),
            ],
            [
                commit.replica,
                commit.epoch,
                commit.expected_version,
                commit.value,
                ",".join(commit.state),
                commit.delta,
                json.dumps(commit.log_entry),
                repr(commit.useful_seconds),
                repr(commit.tokens_merged),
                commit.stale_folded,
                LOG_KEEP,
                len(commit.merged),
                *triples,
            ],
        )
        return _s(reply[0]), int(reply[1])

    async def log_range(self, fragment: int, after: int, upto: int) -> list[dict[str, Any]]:
        """The commit log entries of versions after `after` up to `upto`, oldest first (those
        still kept: the log keeps the last LOG_KEEP)."""
        key = self.keys.log(fragment)
        first = await self.redis.lindex(key, 0)
        if first is None or upto <= after:
            return []
        base = int(json.loads(first)["version"])
        start, end = max(0, after + 1 - base), upto - base
        if end < start:
            return []
        entries = await self.redis.lrange(key, start, end)
        return [json.loads(e) for e in entries]

    async def pending(self, fragments: int) -> list[str]:
        """The uids received into open rounds and not merged yet."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for p in range(fragments):
                pipe.hkeys(self.keys.round(p))
            replies = await pipe.execute()
        return sorted(_s(uid) for reply in replies for uid in reply)


def open_store(url: str, job: str) -> RedisControlStore:
    return RedisControlStore(open_redis(url), job)
