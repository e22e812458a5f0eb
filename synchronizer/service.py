"""The synchronizer's gRPC servicer: learner sessions, state fetches and fragment broadcast.

A replica keeps nothing that is not in the store except the open streams themselves: any
replica can serve any learner, and a learner whose replica dies reconnects to another.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import structlog
from redis.exceptions import RedisError

from services import codec as codecs
from services import telemetry as tm
from services.config import SynchronizerSettings
from services.gen.atoll.v1 import (
    fragment_pb2,
    session_pb2,
    synchronizer_pb2,
    synchronizer_pb2_grpc,
)
from services.layout import FragmentLayout, LayoutError, LeafSpec, fragment_layout
from services.tape import Tape
from services.wire import ChunkAssembler, WireError, make_header, split
from services.wirecount import counting_parser, counting_serializer
from synchronizer.admission import Rejection, check_header, check_payload
from synchronizer.merger import Merger
from synchronizer.store import Store, StoreError

log = structlog.get_logger("atoll.synchronizer")
SERVICE_NAME = synchronizer_pb2.DESCRIPTOR.services_by_name["Synchronizer"].full_name

OUTBOX_LIMIT = 4096  # messages queued for one learner before it counts as too slow
# Whole updates a session holds between reading and storing: the next one's bytes come in
# while the last is written to the store, and a slow store holds the stream back.
STORE_QUEUE = 2
MAX_DELTA_CHAIN = 8  # deltas sent to catch a learner up before a whole value is cheaper


def spec_to_json(specs: list[LeafSpec]) -> str:
    """Canonical JSON of a parameter spec (sorted by leaf name)."""
    ordered = sorted(specs, key=lambda s: s.name)
    return json.dumps([[s.name, list(s.shape), s.dtype] for s in ordered])


def spec_from_json(text: str) -> list[LeafSpec]:
    return [LeafSpec(name, tuple(shape), dtype) for name, shape, dtype in json.loads(text)]


def specs_from_proto(params: list[fragment_pb2.TensorSpec]) -> list[LeafSpec]:
    return [LeafSpec(p.name, tuple(int(d) for d in p.shape), p.dtype or "float32") for p in params]


def specs_to_proto(specs: list[LeafSpec]) -> list[fragment_pb2.TensorSpec]:
    return [fragment_pb2.TensorSpec(name=s.name, shape=s.shape, dtype=s.dtype) for s in specs]


@dataclass(frozen=True)
class _Whole:
    """An update all of whose chunks are in and checked: the store's to take."""

    chunk: session_pb2.UpdateChunk
    payload: bytes


@dataclass(frozen=True)
class _Refused:
    rejection: Rejection
    seq: int


# What a session's reader hands its store worker, in stream order.
_Work = session_pb2.Heartbeat | _Whole | _Refused


class SessionClosed(Exception):
    """Ends a session with a status the learner can act on."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


@dataclass
class Connection:
    learner: str
    incarnation: str
    outbox: asyncio.Queue[session_pb2.SynchronizerMessage | SessionClosed | None] = field(
        default_factory=asyncio.Queue
    )
    sent_versions: dict[int, int] = field(default_factory=dict)
    rejected_seq: int = -1

    def send(self, message: session_pb2.SynchronizerMessage) -> None:
        if self.outbox.qsize() > OUTBOX_LIMIT:
            self.outbox.put_nowait(
                SessionClosed(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "learner reads fragments too slowly; reconnect and fetch the state",
                )
            )
            return
        self.outbox.put_nowait(message)


class SynchronizerService(synchronizer_pb2_grpc.SynchronizerServicer):
    def __init__(self, settings: SynchronizerSettings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.layout: FragmentLayout | None = None
        self.spec: list[LeafSpec] = []
        self.tape = Tape(settings.tape, settings.replica_id)
        self.merger = Merger(
            store,
            settings,
            settings.replica_id,
            self._num_fragments,
            tape=self.tape,
            segments=self._segments,
        )
        self.connections: dict[str, Connection] = {}
        self._initial: dict[str, dict[int, np.ndarray]] = {}
        self._bytes = {"up": 0, "down": 0}

    def _segments(self, fragment: int) -> list[int]:
        if self.layout is None:
            return []
        return [leaf.size for leaf in self.layout.fragments[fragment].leaves]

    def _num_fragments(self) -> int:
        return self.layout.num_fragments if self.layout else 0

    # --- job spec -----------------------------------------------------------------------
    async def adopt_spec(self, spec_json: str) -> None:
        """Learn the job's parameter spec (first learner's, or the checkpoint's)."""
        if self.layout is None:
            self.spec = spec_from_json(spec_json)
            self.layout = fragment_layout(self.spec, self.settings.fragments)

    async def load_known_spec(self) -> None:
        stored = await self.store.spec()
        if stored is not None:
            await self.adopt_spec(stored)

    async def initialize_from(self, arrays: dict[str, np.ndarray]) -> bool:
        """Set the job's initial parameters from named arrays (set-if-absent)."""
        specs = [LeafSpec(k, tuple(v.shape), "float32") for k, v in arrays.items()]
        job_spec = await self.store.register_spec(spec_to_json(specs))
        if job_spec != spec_to_json(specs):
            raise StoreError("the checkpoint's parameters differ from the job's registered model")
        await self.adopt_spec(job_spec)
        assert self.layout is not None
        thetas = [self.layout.gather(p, arrays) for p in range(self.layout.num_fragments)]
        return await self.store.initialize(thetas, [self.merger.optimizer.init(t) for t in thetas])

    # --- sessions -----------------------------------------------------------------------
    async def Session(
        self,
        request_iterator: AsyncIterator[session_pb2.LearnerMessage],
        context: grpc.aio.ServicerContext[
            session_pb2.LearnerMessage, session_pb2.SynchronizerMessage
        ],
    ) -> AsyncIterator[session_pb2.SynchronizerMessage]:
        try:
            first = await anext(request_iterator)
        except StopAsyncIteration:
            return
        try:
            conn, welcome = await self._hello(first)
        except SessionClosed as closed:
            await context.abort(closed.code, closed.details)
            return
        key = f"{conn.learner}/{conn.incarnation}"
        previous = self.connections.pop(key, None)
        if previous is not None:
            previous.outbox.put_nowait(None)
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
            tm.LEARNERS_CONNECTED.set(len(self.connections))
            self._initial.pop(key, None)
            log.info("learner_left", learner=conn.learner, incarnation=conn.incarnation)

    def _count_up(self, size: int) -> None:
        self._bytes["up"] += size
        tm.BYTES.labels(direction="up").inc(size)

    def _count_down(self, size: int) -> None:
        self._bytes["down"] += size
        tm.BYTES.labels(direction="down").inc(size)

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        """The service's RPC handlers, counting every message's bytes as it is (de)serialized."""
        up, down = self._count_up, self._count_down
        handlers = {
            "Session": grpc.stream_stream_rpc_method_handler(
                self.Session,
                request_deserializer=counting_parser(session_pb2.LearnerMessage.FromString, up),
                response_serializer=counting_serializer(
                    session_pb2.SynchronizerMessage.SerializeToString, down
                ),
            ),
            "FetchState": grpc.unary_stream_rpc_method_handler(
                self.FetchState,
                request_deserializer=counting_parser(
                    synchronizer_pb2.FetchStateRequest.FromString, up
                ),
                response_serializer=counting_serializer(
                    fragment_pb2.GlobalFragmentChunk.SerializeToString, down
                ),
            ),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    async def _hello(
        self, message: session_pb2.LearnerMessage
    ) -> tuple[Connection, session_pb2.SynchronizerMessage]:
        if message.WhichOneof("kind") != "hello":
            raise SessionClosed(
                grpc.StatusCode.FAILED_PRECONDITION, "a session must start with a hello message"
            )
        hello = message.hello
        cfg = self.settings
        if hello.job != cfg.job:
            raise SessionClosed(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this synchronizer serves job {cfg.job!r}, not {hello.job!r}; check --job",
            )
        if cfg.token is not None and hello.token != cfg.token:
            raise SessionClosed(
                grpc.StatusCode.UNAUTHENTICATED, "wrong or missing token; pass the job's --token"
            )
        if not hello.learner_id or not hello.incarnation:
            raise SessionClosed(
                grpc.StatusCode.INVALID_ARGUMENT, "hello needs a learner_id and an incarnation"
            )
        try:
            specs = specs_from_proto(list(hello.params))
            fragment_layout(specs, cfg.fragments)
        except LayoutError as err:
            raise SessionClosed(
                grpc.StatusCode.INVALID_ARGUMENT, f"bad model spec: {err}"
            ) from None
        spec_json = spec_to_json(specs)
        joined = await self.store.hello(
            spec_json, hello.learner_id, hello.incarnation, cfg.lease_ttl_s, hello.step
        )
        previous = joined.previous
        if not joined.ok:
            raise SessionClosed(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this learner's model differs from the job's (leaf names or shapes); start it "
                "with the same model flags as the others, or use a new --job",
            )
        if previous and previous != hello.incarnation:
            log.info("learner_new_incarnation", learner=hello.learner_id, previous=previous)
        await self.adopt_spec(spec_json)
        assert self.layout is not None
        versions = await self.store.versions(self.layout.num_fragments)
        # A learner holds at least these versions once it has joined (it fetches whatever
        # moved since, or whatever it lacks): the next commit reaches it as a delta, not as
        # a whole copy of a fragment it already has.
        conn = Connection(
            hello.learner_id, hello.incarnation, sent_versions=dict(enumerate(versions))
        )
        welcome = session_pb2.Welcome(
            config=session_pb2.JobConfig(
                job=cfg.job,
                mode=cfg.mode,
                fragments=cfg.fragments,
                inner_steps=cfg.inner_steps,
                overlap_steps=cfg.overlap_steps,
                codec=_codec_wire(cfg.codec),
                block_size=cfg.block_size,
                merge_alpha=cfg.merge_alpha,
                max_staleness=cfg.max_staleness,
                max_chunk_bytes=cfg.max_chunk_bytes,
                job_steps=cfg.job_steps,
                keep_overlap_progress=cfg.keep_overlap_progress,
            ),
            params=specs_to_proto(self.spec),
            versions=versions,
            initialized=await self.store.is_initialized(),
            synchronizer_id=cfg.replica_id,
            initializer=joined.initializer,
        )
        return conn, session_pb2.SynchronizerMessage(welcome=welcome)

    async def _read(
        self, conn: Connection, request_iterator: AsyncIterator[session_pb2.LearnerMessage]
    ) -> None:
        """Read the stream: assemble and check updates here, store them in order in
        `_work`, so the next update's bytes arrive while the last one is being stored."""
        assembler = ChunkAssembler()
        work: asyncio.Queue[_Work | None] = asyncio.Queue(maxsize=STORE_QUEUE)
        worker = asyncio.create_task(self._work(conn, work))
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "heartbeat":
                    await work.put(message.heartbeat)
                elif kind == "update":
                    admitted = self._admit(conn, assembler, message.update)
                    if admitted is not None:
                        await work.put(admitted)
                else:
                    conn.outbox.put_nowait(
                        SessionClosed(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            f"unexpected {kind} message after hello",
                        )
                    )
                    return
                if worker.done():  # it stopped on a broken store: end the session
                    return
            await work.put(None)
            await worker
            await self.store.leave(conn.learner, conn.incarnation)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        except Exception as err:  # a broken store must not kill the replica
            log.warning("session_error", learner=conn.learner, error=str(err))
        finally:
            worker.cancel()
            conn.outbox.put_nowait(None)

    async def _work(self, conn: Connection, work: asyncio.Queue[_Work | None]) -> None:
        """Store what the reader admitted, one item at a time, in the stream's order."""
        try:
            while (item := await work.get()) is not None:
                if isinstance(item, session_pb2.Heartbeat):
                    await self._heartbeat(conn, item)
                    continue
                if isinstance(item, _Refused):
                    ack = await self._refuse(conn, item.rejection, item.seq)
                else:
                    ack = await self._store_update(conn, item.chunk, item.payload)
                conn.send(session_pb2.SynchronizerMessage(ack=ack))
        except asyncio.CancelledError:
            pass
        except Exception as err:  # a broken store must not kill the replica
            log.warning("session_error", learner=conn.learner, error=str(err))

    async def _heartbeat(self, conn: Connection, hb: session_pb2.Heartbeat) -> None:
        steps_done = await self.store.heartbeat(
            conn.learner,
            conn.incarnation,
            self.settings.lease_ttl_s,
            step=hb.step,
            ema=hb.step_time_ema_s if math.isfinite(hb.step_time_ema_s) else 0.0,
            tokens_s=hb.tokens_per_s if math.isfinite(hb.tokens_per_s) else 0.0,
            loss=hb.loss if math.isfinite(hb.loss) else -1.0,
            eval_loss=hb.eval_loss if math.isfinite(hb.eval_loss) else -1.0,
            done=1.0 if hb.done else 0.0,
            last_sent=1.0 if hb.last_sent or hb.done else 0.0,
            still_to_send=list(hb.still_to_send) if hb.finishing and not hb.last_sent else None,
        )
        if steps_done is None:
            conn.outbox.put_nowait(
                SessionClosed(
                    grpc.StatusCode.ABORTED,
                    "a newer incarnation of this learner id has joined; this one must stop",
                )
            )
        elif self.settings.job_steps:
            budget = self.settings.job_steps
            status = session_pb2.JobStatus(
                steps_done=steps_done, job_steps=budget, finish=steps_done >= budget
            )
            conn.send(session_pb2.SynchronizerMessage(status=status))

    def _admit(
        self, conn: Connection, assembler: ChunkAssembler, chunk: session_pb2.UpdateChunk
    ) -> _Work | None:
        """One chunk in: None while its update is incomplete (or already refused), then the
        whole update to store, or its refusal. Pure checks; nothing is stored here."""
        if chunk.seq == conn.rejected_seq:
            return None  # the rest of an update already refused: one refusal per update
        try:
            if self.layout is None:
                raise Rejection("bad_request", grpc.StatusCode.FAILED_PRECONDITION, "no job spec")
            header = chunk.header
            codec = check_header(header, chunk.kind, chunk.c_steps, self.layout)
            try:
                payload = assembler.feed(header, chunk.chunk_index, chunk.data)
            except WireError as err:
                reason = "checksum" if "checksum" in str(err) else "out_of_order"
                raise Rejection(reason, grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
            if payload is None:
                return None
            check_payload(header, codec, payload)
        except Rejection as rejection:
            assembler.reset()
            conn.rejected_seq = chunk.seq
            return _Refused(rejection, chunk.seq)
        return _Whole(chunk, payload)

    async def _refuse(self, conn: Connection, rejection: Rejection, seq: int) -> session_pb2.Ack:
        await self._count_rejection(rejection.reason)
        log.info(
            "update_rejected",
            learner=conn.learner,
            reason=rejection.reason,
            detail=rejection.message,
        )
        return session_pb2.Ack(
            seq=seq,
            status=session_pb2.ACK_STATUS_REJECTED,
            code=rejection.code.value[0],
            reason=rejection.message,
        )

    async def _store_update(
        self, conn: Connection, chunk: session_pb2.UpdateChunk, payload: bytes
    ) -> session_pb2.Ack:
        try:
            if chunk.kind == session_pb2.UPDATE_KIND_INITIAL:
                return await self._initial_fragment(conn, chunk, payload)
            return await self._submit(conn, chunk, payload)
        except (RedisError, StoreError, OSError) as err:
            log.warning("store_unavailable", learner=conn.learner, error=str(err))
            return session_pb2.Ack(
                seq=chunk.seq,
                status=session_pb2.ACK_STATUS_REJECTED,
                code=grpc.StatusCode.UNAVAILABLE.value[0],
                reason="the synchronizer cannot reach its store right now; resend the update",
            )

    async def _initial_fragment(
        self, conn: Connection, chunk: session_pb2.UpdateChunk, payload: bytes
    ) -> session_pb2.Ack:
        assert self.layout is not None
        key = f"{conn.learner}/{conn.incarnation}"
        parts = self._initial.setdefault(key, {})
        parts[chunk.header.fragment] = np.frombuffer(payload, "<f4").copy()
        status = session_pb2.ACK_STATUS_ACCEPTED
        if len(parts) == self.layout.num_fragments:
            thetas = [parts[p] for p in range(self.layout.num_fragments)]
            won = await self.store.initialize(
                thetas, [self.merger.optimizer.init(t) for t in thetas]
            )
            self._initial.pop(key, None)
            if not won:
                status = session_pb2.ACK_STATUS_ALREADY_INITIALIZED
            log.info("job_initialized" if won else "job_already_initialized", learner=conn.learner)
        return session_pb2.Ack(seq=chunk.seq, status=status)

    async def _submit(
        self, conn: Connection, chunk: session_pb2.UpdateChunk, payload: bytes
    ) -> session_pb2.Ack:
        header = chunk.header
        meta = {
            "learner": conn.learner,
            "incarnation": conn.incarnation,
            "seq": chunk.seq,
            "codec": _codec_name(header.codec),
            "block_size": header.block_size,
            "num_elements": header.num_elements,
            "c_steps": chunk.c_steps,
            "c_tokens": chunk.c_tokens,
            "compute_seconds": chunk.compute_seconds,
            "base_version": chunk.base_version,
        }
        uid = f"{conn.learner}/{conn.incarnation}/{chunk.seq}"
        result = await self.store.submit(
            header.fragment,
            uid,
            conn.learner,
            chunk.seq,
            chunk.base_version,
            self.settings.max_staleness,
            payload,
            meta,
        )
        if result.status == "accepted":
            tm.UPDATES_ACCEPTED.inc()
            self.tape.write("accepted", uid=uid, fragment=header.fragment, learner=conn.learner)
            asyncio.create_task(self._evaluate(header.fragment))  # noqa: RUF006
            return session_pb2.Ack(
                seq=chunk.seq, status=session_pb2.ACK_STATUS_ACCEPTED, version=result.version
            )
        if result.status == "duplicate":
            tm.UPDATES_DUPLICATE.inc()
            return session_pb2.Ack(
                seq=chunk.seq, status=session_pb2.ACK_STATUS_DUPLICATE, version=result.version
            )
        reason, code, message = {
            "stale": (
                "stale",
                grpc.StatusCode.FAILED_PRECONDITION,
                f"update is based on version {chunk.base_version}, fragment is at "
                f"{result.version}: more than {self.settings.max_staleness} behind; fetch the "
                "fragment and continue from it",
            ),
            "future": (
                "bad_request",
                grpc.StatusCode.INVALID_ARGUMENT,
                f"update claims base version {chunk.base_version}, newer than the fragment's "
                f"{result.version}; the learner's state is corrupt, restart it",
            ),
        }.get(
            result.status,
            (
                "bad_request",
                grpc.StatusCode.FAILED_PRECONDITION,
                "the job has no initial parameters yet; send them (kind INITIAL) first",
            ),
        )
        await self._count_rejection(reason)
        return session_pb2.Ack(
            seq=chunk.seq,
            status=session_pb2.ACK_STATUS_REJECTED,
            code=code.value[0],
            reason=message,
            version=result.version,
        )

    async def _count_rejection(self, reason: str) -> None:
        tm.UPDATES_REJECTED.labels(reason=reason).inc()
        # The metric has it; the job's total misses one while the store is away.
        with contextlib.suppress(RedisError, OSError):
            await self.store.add_stats(updates_rejected=1)

    async def _evaluate(self, fragment: int) -> None:
        try:
            await self.merger.evaluate(fragment)
        except Exception as err:
            log.warning("evaluate_failed", fragment=fragment, error=str(err))

    # --- state and broadcast ------------------------------------------------------------
    async def fragment_chunks(
        self, fragment: int, held: int | None = None
    ) -> list[fragment_pb2.GlobalFragmentChunk]:
        """The fragment's whole current value, chunked; or, when its checksum is `held` (the
        learner already has it), one chunk without data that says so."""
        version, payload = await self.store.global_value(fragment)
        size = self.settings.max_chunk_bytes
        header = make_header(fragment, fragment_pb2.CODEC_FP32, 0, len(payload) // 4, payload, size)
        if held is not None and header.checksum == held:
            header.chunk_count, header.total_bytes = 1, 0
            return [
                fragment_pb2.GlobalFragmentChunk(header=header, version=version, unchanged=True)
            ]
        return [
            fragment_pb2.GlobalFragmentChunk(header=header, version=version, chunk_index=i, data=d)
            for i, d in enumerate(split(payload, size))
        ]

    async def FetchState(
        self,
        request: synchronizer_pb2.FetchStateRequest,
        context: grpc.aio.ServicerContext[
            synchronizer_pb2.FetchStateRequest, fragment_pb2.GlobalFragmentChunk
        ],
    ) -> AsyncIterator[fragment_pb2.GlobalFragmentChunk]:
        if request.job != self.settings.job:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this synchronizer serves job {self.settings.job!r}, not {request.job!r}",
            )
        if self.layout is None or not await self.store.is_initialized():
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the job has no global parameters yet; a learner must join first",
            )
        assert self.layout is not None
        wanted = list(request.fragments) or list(range(self.layout.num_fragments))
        bad = [p for p in wanted if p >= self.layout.num_fragments]
        if bad:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"fragments {bad} do not exist; this job has 0..{self.layout.num_fragments - 1}",
            )
        for p in wanted:
            for chunk in await self.fragment_chunks(p, request.held.get(p)):
                yield chunk

    async def broadcast_forever(self) -> None:
        """Push every committed fragment to the learners this replica serves.

        If the store goes away the subscription is renewed, and every fragment is pushed
        again once it is back, so no commit made meanwhile goes unannounced.
        """
        while True:
            try:
                pubsub = await self.store.subscribe_commits()
                try:
                    for p in range(self._num_fragments()):
                        await self._push(p)
                    while True:
                        message = await pubsub.get_message(timeout=1.0)
                        if message is not None:
                            await self._push(int(json.loads(message["data"])["fragment"]))
                finally:
                    await pubsub.aclose()
            except (RedisError, StoreError, OSError) as err:
                log.warning("broadcast_interrupted", error=str(err))
                await asyncio.sleep(0.5)
            except Exception:  # a bug must not silence every push of this replica for good
                log.exception("broadcast_failed")
                await asyncio.sleep(0.5)

    async def _push(self, fragment: int) -> None:
        """Bring every learner this replica serves to the fragment's newest version: the
        encoded deltas since the version it was last sent, or, for a learner new to this
        replica or further behind than the deltas kept, the whole value."""
        if self.layout is None:
            await self.load_known_spec()
        if not self.connections or not await self.store.is_initialized():
            return
        version = (await self.store.versions(fragment + 1))[fragment]
        tm.FRAGMENT_VERSION.labels(fragment=str(fragment)).set(version)
        full: list[fragment_pb2.GlobalFragmentChunk] = []  # read only if someone needs it
        deltas: dict[int, list[fragment_pb2.GlobalFragmentChunk] | None] = {}
        for conn in list(self.connections.values()):
            last = conn.sent_versions.get(fragment, -1)
            if last >= version:
                continue
            chunks: list[fragment_pb2.GlobalFragmentChunk] = []
            if last >= 0 and version - last <= MAX_DELTA_CHAIN:
                for v in range(last + 1, version + 1):
                    if v not in deltas:
                        deltas[v] = await self._delta_chunks(fragment, v)
                    step = deltas[v]
                    if step is None:  # no longer kept: the whole value instead
                        chunks = []
                        break
                    chunks += step
            if not chunks:
                full = full or await self.fragment_chunks(fragment)
                chunks = full
            conn.sent_versions[fragment] = max(version, chunks[0].version)
            for chunk in chunks:
                conn.send(session_pb2.SynchronizerMessage(fragment=chunk))

    async def _delta_chunks(
        self, fragment: int, version: int
    ) -> list[fragment_pb2.GlobalFragmentChunk] | None:
        payload = await self.store.delta(fragment, version)
        if payload is None or self.layout is None:
            return None
        n = self.layout.fragments[fragment].num_elements
        size = self.settings.max_chunk_bytes
        codec = codecs.by_name(self.settings.downlink_codec)
        header = make_header(fragment, codec.wire, self.settings.block_size, n, payload, size)
        return [
            fragment_pb2.GlobalFragmentChunk(
                header=header,
                version=version,
                chunk_index=i,
                data=d,
                delta=True,
                base_version=version - 1,
            )
            for i, d in enumerate(split(payload, size))
        ]

    async def flush_stats(self) -> None:
        """Add the bytes counted since the last flush to the job's totals in the store."""
        up, down = self._bytes["up"], self._bytes["down"]
        self._bytes = {"up": 0, "down": 0}
        try:
            await self.store.add_stats(bytes_up=up, bytes_down=down)
        except Exception:  # the store is away: keep the counts for the next flush
            self._bytes["up"] += up
            self._bytes["down"] += down

    async def flush_stats_forever(self, interval: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.flush_stats()


def _codec_wire(name: str) -> fragment_pb2.Codec.ValueType:
    return codecs.by_name(name).wire  # type: ignore[return-value]


def _codec_name(wire: int) -> str:
    return codecs.by_wire(wire).name
