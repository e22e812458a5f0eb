"""Learners' control sessions: hello, heartbeats, the owner map and commit notices.

Any replica serves any learner's session. It watches the fragments' versions and owners in
Redis, tells each learner it serves the owner map and which of its updates a commit merged,
and tells learners of several processes of new versions (they fetch their own ranges,
`fetch`). New global values themselves come from each fragment's owner (`followers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import structlog

from services import telemetry as tm
from services.config import SynchronizerSettings, job_config_to_proto
from services.gen.atoll.v1 import fragment_pb2, session_pb2
from services.layout import FragmentLayout, LayoutError, LeafSpec, fragment_layout
from services.outage import OutageLog, every
from services.tape import Tape
from synchronizer import auth
from synchronizer.core.admission import (
    Rejection,
    check_heartbeat,
    check_hello,
    check_spec,
    counted_steps,
    spec_digest,
)
from synchronizer.ownership import Ownership
from synchronizer.refusals import grpc_status
from synchronizer.store.control import ControlStore, SessionReopened

log = structlog.get_logger("atoll.synchronizer.session")

OUTBOX_LIMIT = 4096  # messages queued for one learner before it counts as too slow
WATCH_S = 0.05  # how often the fragments' versions and owners are read


def spec_to_json(specs: list[LeafSpec]) -> str:
    """Canonical JSON of a parameter spec (sorted by leaf name)."""
    ordered = sorted(specs, key=lambda s: s.name)
    return json.dumps([[s.name, list(s.shape), s.dtype] for s in ordered])


def spec_from_json(text: str) -> list[LeafSpec]:
    return [LeafSpec(name, tuple(shape), dtype) for name, shape, dtype in json.loads(text)]


def specs_from_proto(params: Sequence[fragment_pb2.TensorSpec]) -> list[LeafSpec]:
    return [LeafSpec(p.name, tuple(int(d) for d in p.shape), p.dtype or "float32") for p in params]


def specs_to_proto(specs: list[LeafSpec]) -> list[fragment_pb2.TensorSpec]:
    return [fragment_pb2.TensorSpec(name=s.name, shape=s.shape, dtype=s.dtype) for s in specs]


def parse_spec(params: Sequence[fragment_pb2.TensorSpec], fragments: int) -> str:
    """A hello's parameter spec, checked leaf by leaf and against the layout, as canonical
    JSON (raises Rejection, LayoutError). Run off the event loop: a spec may hold up to
    MAX_LEAVES leaves."""
    check_spec(params)
    specs = specs_from_proto(params)
    fragment_layout(specs, fragments)
    return spec_to_json(specs)


class SessionClosed(Exception):
    """Ends a session with a status the learner can act on."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


MAX_KNOWN_SPECS = 8  # digests of hello specs known to be the job's, kept per replica


def model_differs() -> SessionClosed:
    return SessionClosed(
        grpc.StatusCode.FAILED_PRECONDITION,
        "this learner's model differs from the job's (leaf names or shapes); start it with the "
        "same model flags as the others, or use a new --job",
    )


def pool_prefix(caller: auth.Identity, slot: str) -> str:
    """The slot prefix of the pool credential `slot` is spoken for by ('' if the caller's
    credential names the slot itself, or any slot: the shared token, anonymous)."""
    if caller.patterns is None or slot in caller.patterns:
        return ""
    return next(
        (p[:-1] for p in caller.patterns if p.endswith("*") and slot.startswith(p[:-1])), ""
    )


def busy(slot: str) -> SessionClosed:
    return SessionClosed(
        grpc.StatusCode.ALREADY_EXISTS,
        f"learner slot {slot!r} has a live session already; a new one may start once it ends "
        "or its lease lapses (retrying)",
    )


# A session whose learner opened a newer one (it reconnected) ends with this.
REOPENED = SessionClosed(
    grpc.StatusCode.UNAVAILABLE,
    "this learner opened a newer session (it reconnected); this one ends",
)


@dataclass
class Connection:
    learner: str
    incarnation: str
    session: int = 0  # the slot's count of hellos when this one opened (`lua/hello.lua`)
    outbox: asyncio.Queue[session_pb2.SynchronizerMessage | SessionClosed | None] = field(
        default_factory=asyncio.Queue
    )
    told_versions: dict[int, int] = field(default_factory=dict)  # notices sent, per fragment
    notified: dict[int, int] = field(default_factory=dict)  # commits told of, per fragment
    notices: bool = False  # told new versions; fetches their values itself (by ranges)
    # The slot's steps toward the job's budget, and when they were last counted (monotonic).
    counted_steps: float = 0.0
    counted_at: float = field(default_factory=time.monotonic)
    rate_bound_told: bool = False  # the log said once that this session's claims ran ahead

    @property
    def prefix(self) -> str:
        return f"{self.learner}/{self.incarnation}/"

    def send(self, message: session_pb2.SynchronizerMessage) -> None:
        if self.outbox.qsize() > OUTBOX_LIMIT:
            self.outbox.put_nowait(
                SessionClosed(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "learner reads its session too slowly; reconnect and fetch the state",
                )
            )
            return
        self.outbox.put_nowait(message)


class Sessions:
    def __init__(
        self,
        settings: SynchronizerSettings,
        store: ControlStore,
        ownership: Ownership,
        tape: Tape,
        layout: Callable[[], FragmentLayout | None],
        adopt_spec: Callable[[str], None],
    ) -> None:
        self.settings, self.store = settings, store
        self.ownership, self.tape = ownership, tape
        self._layout, self._adopt_spec = layout, adopt_spec
        self.connections: dict[str, Connection] = {}
        self.owner_map: list[session_pb2.FragmentOwner] = []
        self._greeting: set[str] = set()  # slots whose hello this replica is answering
        self._known_specs: dict[bytes, str] = {}  # spec digest -> the job's spec (JSON)
        self._spec_reads = asyncio.Semaphore(1)  # specs read leaf by leaf: one at a time
        self._spec_welcome: tuple[str, session_pb2.Welcome] | None = None  # its params only

    # --- the control stream ---------------------------------------------------------------
    async def Session(
        self,
        request_iterator: AsyncIterator[session_pb2.LearnerMessage],
        context: grpc.aio.ServicerContext[
            session_pb2.LearnerMessage, session_pb2.SynchronizerMessage
        ],
    ) -> AsyncIterator[session_pb2.SynchronizerMessage]:
        """A learner's control session (new global values come from each fragment's owner,
        on the learner's Follow calls: `followers`)."""
        try:
            first = await asyncio.wait_for(anext(request_iterator), self.settings.hello_timeout_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no hello within {self.settings.hello_timeout_s:.0f} s of opening the session",
            )
            return
        try:
            conn, welcome = await self._hello(first)
        except SessionClosed as closed:
            await context.abort(closed.code, closed.details)
            return
        # This session's lines (and its reader task's) name the learner once, here.
        structlog.contextvars.bind_contextvars(learner=conn.learner, incarnation=conn.incarnation)
        key = conn.prefix
        replaced = self.connections.get(key)
        if replaced is not None:
            replaced.outbox.put_nowait(REOPENED)
        self.connections[key] = conn
        tm.LEARNERS_CONNECTED.set(len(self.connections))
        reader = asyncio.create_task(self._read(conn, request_iterator))
        log.info("learner_joined", learner=conn.learner, incarnation=conn.incarnation)
        try:
            yield welcome
            while True:
                item = await conn.outbox.get()
                if item is None:
                    break
                if isinstance(item, SessionClosed):
                    await context.abort(item.code, item.details)
                    return
                yield item
        finally:
            reader.cancel()
            if self.connections.get(key) is conn:
                del self.connections[key]
                # The slot's session ended here: a new one may start at once.
                with contextlib.suppress(Exception):
                    await self.store.leave(conn.learner, conn.incarnation, conn.session)
            tm.LEARNERS_CONNECTED.set(len(self.connections))
            log.info("learner_left", learner=conn.learner, incarnation=conn.incarnation)

    async def _hello(
        self, message: session_pb2.LearnerMessage
    ) -> tuple[Connection, session_pb2.SynchronizerMessage]:
        if message.WhichOneof("kind") != "hello":
            raise SessionClosed(
                grpc.StatusCode.FAILED_PRECONDITION, "a session must start with a hello message"
            )
        hello = message.hello
        cfg = self.settings
        try:
            check_hello(hello, cfg.job)
            auth.check_slot(hello.learner_id)
        except Rejection as rejection:
            raise SessionClosed(*grpc_status(rejection)) from None
        except auth.AuthError as err:
            raise SessionClosed(err.code, err.details) from None
        slot = hello.learner_id
        # One session per slot; the same incarnation again is that learner reconnecting (its
        # old stream broke without this side seeing it yet): its new session replaces the old.
        others = (c for c in self.connections.values() if c.learner == slot)
        if slot in self._greeting or any(c.incarnation != hello.incarnation for c in others):
            raise busy(slot)
        self._greeting.add(slot)
        try:
            return await self._join(hello)
        finally:
            self._greeting.discard(slot)

    async def _spec(self, hello: session_pb2.Hello) -> tuple[bytes, str]:
        """The hello's spec as canonical JSON, and its digest. A spec whose digest is known
        is the job's. Another is refused unread if its leaf count is not the job's, else read
        leaf by leaf, off the event loop and one spec at a time."""
        digest = await asyncio.to_thread(spec_digest, hello)
        known = self._known_specs.get(digest)
        if known is not None:
            return digest, known
        layout = self._layout()
        if layout is not None and len(hello.params) != sum(len(f.leaves) for f in layout.fragments):
            raise model_differs()
        async with self._spec_reads:
            try:
                spec = await asyncio.to_thread(parse_spec, hello.params, self.settings.fragments)
            except Rejection as rejection:
                raise SessionClosed(*grpc_status(rejection)) from None
            except LayoutError as err:
                raise SessionClosed(
                    grpc.StatusCode.INVALID_ARGUMENT, f"bad model spec: {err}"
                ) from None
        return digest, spec

    async def _join(
        self, hello: session_pb2.Hello
    ) -> tuple[Connection, session_pb2.SynchronizerMessage]:
        cfg = self.settings
        digest, spec_json = await self._spec(hello)
        initialized = await self.store.is_initialized(cfg.fragments)
        other = bool(cfg.initializer) and hello.learner_id != cfg.initializer
        if other and await self.store.spec() is None:
            # The operator's initializer fixes the job's spec, never whoever says hello first.
            raise SessionClosed(
                grpc.StatusCode.UNAVAILABLE,
                f"the job's model spec comes from its initializer slot {cfg.initializer!r} "
                "(--initializer), which has not said hello yet; retrying",
            )
        joined = await self.store.hello(
            spec_json,
            hello.learner_id,
            hello.incarnation,
            cfg.lease_ttl_s,
            hello.step,
            initialized or other,  # only the initializer may claim to send first values
            pool=(pool_prefix(auth.CALLER.get(), hello.learner_id), cfg.pool_size),
        )
        if joined.status == "busy":
            raise busy(hello.learner_id)
        if joined.status == "pool_full":
            raise SessionClosed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this credential speaks for a pool of slots, which holds {cfg.pool_size} live "
                "sessions already (--pool-size); a new one may start once one ends",
            )
        if joined.status != "ok":
            raise model_differs()
        if len(self._known_specs) < MAX_KNOWN_SPECS:
            self._known_specs[digest] = spec_json
        if joined.previous and joined.previous != hello.incarnation:
            log.info("learner_new_incarnation", learner=hello.learner_id, previous=joined.previous)
        self._adopt_spec(spec_json)
        layout = self._layout()
        assert layout is not None
        versions = [v or 0 for v in await self.store.versions(layout.num_fragments)]
        # A learner holds at least these versions once it has joined (it fetches whatever
        # moved since): the next commit reaches it as a delta, not as a whole copy.
        conn = Connection(
            hello.learner_id,
            hello.incarnation,
            session=joined.session,
            told_versions=dict(enumerate(versions)),
            notified=dict(enumerate(versions)),
            notices=hello.version_notices,
            counted_steps=float(joined.counted_steps),
        )
        welcome = session_pb2.Welcome()
        welcome.CopyFrom(await self._welcome_params(spec_json))
        details = session_pb2.Welcome(
            config=job_config_to_proto(cfg),
            versions=versions,
            initialized=initialized,
            synchronizer_id=cfg.replica_id,
            initializer=joined.initializer,
            owners=await self._owners(layout.num_fragments),
        )
        status = self._job_status(joined.steps_done)
        if status is not None:
            details.status.CopyFrom(status)
        welcome.MergeFrom(details)
        return conn, session_pb2.SynchronizerMessage(welcome=welcome)

    async def _welcome_params(self, spec_json: str) -> session_pb2.Welcome:
        """A welcome holding the job's spec only, built once, off the event loop (a spec may
        hold up to MAX_LEAVES leaves); a welcome starts as a copy of it."""
        if self._spec_welcome is None or self._spec_welcome[0] != spec_json:

            def build() -> session_pb2.Welcome:
                return session_pb2.Welcome(params=specs_to_proto(spec_from_json(spec_json)))

            self._spec_welcome = (spec_json, await asyncio.to_thread(build))
        return self._spec_welcome[1]

    async def _read(
        self, conn: Connection, request_iterator: AsyncIterator[session_pb2.LearnerMessage]
    ) -> None:
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "heartbeat":
                    if not await self._heartbeat(conn, message.heartbeat):
                        return
                else:
                    conn.outbox.put_nowait(
                        SessionClosed(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            f"unexpected {kind} message after hello; updates go to the "
                            "fragment's owner on an Ingest call",
                        )
                    )
                    return
            await self.store.leave(conn.learner, conn.incarnation, conn.session)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        except Exception as err:  # a broken store must not kill the replica
            log.warning("session_error", learner=conn.learner, error=str(err))
        finally:
            conn.outbox.put_nowait(None)

    async def _heartbeat(self, conn: Connection, hb: session_pb2.Heartbeat) -> bool:
        """Renew the learner's lease; False once the session is to close."""
        try:
            check_heartbeat(hb)
        except Rejection as rejection:
            conn.outbox.put_nowait(SessionClosed(*grpc_status(rejection)))
            return False
        now = time.monotonic()
        rate = self.settings.max_steps_per_s
        counted = counted_steps(conn.counted_steps, hb.step, now - conn.counted_at, rate)
        conn.counted_steps, conn.counted_at = counted, now
        if counted < hb.step and not conn.rate_bound_told:
            conn.rate_bound_told = True
            log.warning(
                "steps_counted_at_bound",
                learner=conn.learner,
                claimed=hb.step,
                counted=int(counted),
                max_steps_per_s=rate,
                hint="raise --max-steps-per-s if this learner really steps this fast",
            )
        try:
            steps_done = await self.store.heartbeat(
                conn.learner,
                conn.incarnation,
                conn.session,
                self.settings.lease_ttl_s,
                int(counted),
                step=float(hb.step),
                ema=hb.step_time_ema_s,
                tokens_s=hb.tokens_per_s,
                loss=hb.loss if math.isfinite(hb.loss) else -1.0,
                eval_loss=hb.eval_loss if math.isfinite(hb.eval_loss) else -1.0,
                done=1.0 if hb.done else 0.0,
                last_sent=1.0 if hb.last_sent or hb.done else 0.0,
                still_to_send=list(hb.still_to_send) if hb.finishing and not hb.last_sent else None,
            )
        except SessionReopened:
            conn.outbox.put_nowait(REOPENED)
            return False
        if steps_done is None:
            conn.outbox.put_nowait(
                SessionClosed(
                    grpc.StatusCode.ABORTED,
                    "a newer incarnation of this learner id has joined; this one must stop",
                )
            )
            return False
        status = self._job_status(steps_done)
        if status is not None:
            conn.send(session_pb2.SynchronizerMessage(status=status))
        return True

    def _job_status(self, steps_done: int) -> session_pb2.JobStatus | None:
        """Where the job's budget stands at `steps_done` steps over all slots (None: the job
        has no budget), as a welcome and each heartbeat's reply tell it."""
        budget = self.settings.job_steps
        if not budget:
            return None
        return session_pb2.JobStatus(
            steps_done=steps_done, job_steps=budget, finish=steps_done >= budget
        )

    # --- the owner map ----------------------------------------------------------------------
    async def _owners(self, fragments: int) -> list[session_pb2.FragmentOwner]:
        owners = await self.store.owners(fragments)
        addresses = self.ownership.replicas or await self.store.register(
            self.ownership.replica, self.ownership.address, 4.0
        )
        out = []
        for p, owner in enumerate(owners):
            if owner is None or owner[0] not in addresses:
                continue
            out.append(
                session_pb2.FragmentOwner(
                    fragment=p, replica=owner[0], address=addresses[owner[0]], epoch=owner[1]
                )
            )
        return out

    # --- keeping learners up to date ------------------------------------------------------
    async def watch_forever(self) -> None:
        """Follow the fragments' versions and owners; tell the learners this replica serves."""
        outage = OutageLog(log, "watch_interrupted", "watch_resumed")
        await every(WATCH_S, self.watch, outage)

    async def watch(self) -> None:
        layout = self._layout()
        if layout is None:
            spec = await self.store.spec()
            if spec is None:
                return
            self._adopt_spec(spec)
            layout = self._layout()
            assert layout is not None
        owners = await self._owners(layout.num_fragments)
        if owners != self.owner_map:
            self.owner_map = owners
            message = session_pb2.SynchronizerMessage(owners=session_pb2.OwnerMap(owners=owners))
            for conn in list(self.connections.values()):
                conn.send(message)
        versions = await self.store.versions(layout.num_fragments)
        for p, version in enumerate(versions):
            if version is None:
                continue
            tm.FRAGMENT_VERSION.labels(fragment=str(p)).set(version)
            await self._notify_commits(p, version)
            self._tell_versions(p, version)

    async def _notify_commits(self, fragment: int, version: int) -> None:
        """COMMITTED acks to the learners whose updates the versions each learner has not
        been told of yet merged (from the version its session started at)."""
        behind = [c for c in self.connections.values() if c.notified.get(fragment, 0) < version]
        if not behind:
            return
        lowest = min(c.notified.get(fragment, 0) for c in behind)
        entries = await self.store.log_range(fragment, lowest, version)
        for conn in behind:
            told = conn.notified.get(fragment, 0)
            for entry in entries:
                if int(entry["version"]) <= told:
                    continue
                for uid in entry["uids"]:
                    prefix, seq = uid.rsplit("/", 1)
                    if prefix + "/" == conn.prefix:
                        conn.send(
                            session_pb2.SynchronizerMessage(
                                ack=session_pb2.Ack(
                                    seq=int(seq),
                                    fragment=fragment,
                                    status=session_pb2.ACK_STATUS_COMMITTED,
                                    version=int(entry["version"]),
                                )
                            )
                        )
            conn.notified[fragment] = version

    def _tell_versions(self, fragment: int, version: int) -> None:
        """Tell the sessions that asked for notices (learners of several processes, which
        fetch their own ranges of each new version) of the fragment's newest version."""
        for conn in list(self.connections.values()):
            if conn.notices and conn.told_versions.get(fragment, -1) < version:
                conn.told_versions[fragment] = version
                notice = session_pb2.FragmentVersion(fragment=fragment, version=version)
                conn.send(session_pb2.SynchronizerMessage(version=notice))
