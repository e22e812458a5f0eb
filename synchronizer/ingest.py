"""The Ingest call: one update of one fragment, chunk by chunk, into the fragment's owner.

Every chunk is checked before it changes anything: the header against the job's layout, the
chunk's place and size against the fragment, its bytes against the codec. Chunks are summed
as they arrive; the update is recorded once whole and its checksum verified, and taken out
again if anything fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
import numpy as np
import structlog
import xxhash

from services import codec as codecs
from services import telemetry as tm
from services.config import JobConfig
from services.gen.atoll.v1 import session_pb2
from services.layout import FragmentLayout
from synchronizer import auth
from synchronizer.core.admission import (
    Arrived,
    Rejection,
    Status,
    check_chunk,
    check_header,
    check_update_fields,
    initial_values,
)
from synchronizer.owner import FragmentOwner
from synchronizer.ownership import Ownership
from synchronizer.parts import Gathering, Parts, Summing, begin_update, combined_checksum
from synchronizer.records import NormTooLarge
from synchronizer.store.control import ControlStore
from synchronizer.worker import WorkerShutDown

log = structlog.get_logger("atoll.synchronizer.ingest")

WAIT_READ = tm.INGEST_WAIT_SECONDS.labels(phase="read")
WAIT_SUM = tm.INGEST_WAIT_SECONDS.labels(phase="sum")
WAIT_RECORD = tm.INGEST_WAIT_SECONDS.labels(phase="record")
WAIT_DOWNLINK = tm.INGEST_WAIT_SECONDS.labels(phase="downlink")

NOT_OWNER = "not the owner of fragment {p}; look up the owner map again and resend"

REFUSALS: dict[str, tuple[str, Status, str]] = {
    "stale": (
        "stale",
        Status.FAILED_PRECONDITION,
        "update is based on version {base}, fragment is at {version}: more than "
        "{max_staleness} behind; fetch the fragment and continue from it",
    ),
    "future": (
        "bad_request",
        Status.INVALID_ARGUMENT,
        "update claims base version {base}, newer than the fragment's {version}; the "
        "learner's state is corrupt, restart it",
    ),
    "uninitialized": (
        "bad_request",
        Status.FAILED_PRECONDITION,
        "fragment {p} has no global value yet; send the job's initial parameters first",
    ),
    "checksum": (
        "checksum",
        Status.INVALID_ARGUMENT,
        "update {seq} was received before with other bytes; a retry must resend the same update",
    ),
    "superseded": (
        "bad_request",
        Status.FAILED_PRECONDITION,
        "incarnation {incarnation!r} of learner slot {learner!r} is not the slot's current one "
        "(a newer one said hello since, or this one never did): this process must stop; a "
        "learner sends its updates under the incarnation of its session",
    ),
}


@dataclass
class Waits:
    """What one Ingest call waited for besides reading and summing."""

    downlink: float = 0.0  # the replica's learners to catch up on global fragments


class Ingest:
    def __init__(
        self,
        config: JobConfig,
        store: ControlStore,
        ownership: Ownership,
        layout: Callable[[], FragmentLayout | None],
        max_per_slot: int = 8,
        parts_timeout_s: float = 60.0,
        downlink_caught_up: Callable[[], Awaitable[float]] | None = None,
        first_chunk_timeout_s: float = 10.0,
    ) -> None:
        self.config, self.store, self.ownership, self._layout = config, store, ownership, layout
        # Waits while the replica's learners are behind on global fragments (Sessions).
        self.downlink_caught_up = downlink_caught_up
        self.max_per_slot = max_per_slot
        self.first_chunk_timeout_s = first_chunk_timeout_s
        # Ingest calls per learner slot (and, for a learner of several processes, per part)
        self.in_flight: Counter[tuple[str, int]] = Counter()
        self.parts = Parts(parts_timeout_s)

    async def Ingest(
        self,
        request_iterator: AsyncIterator[Arrived],
        context: grpc.aio.ServicerContext[Arrived, session_pb2.Ack],
    ) -> session_pb2.Ack:
        # Counted from the call's start, by the caller's credential (its one slot, else the
        # credential on this connection), so calls that never send a chunk are bounded too.
        caller = auth.CALLER.get()
        opening = (caller.only_slot or f"{caller.name} {context.peer()}", -1)
        await self._enter(
            opening,
            context,
            f"this caller has {self.max_per_slot} Ingest calls open that sent no chunk yet "
            "(--max-ingest-per-slot); send their chunks or end them",
        )
        try:
            arrived = await asyncio.wait_for(anext(request_iterator), self.first_chunk_timeout_s)
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an Ingest call sent no chunk")
            raise
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"an Ingest call sent no chunk within {self.first_chunk_timeout_s:g} s "
                "(--hello-timeout-s); send the update's first chunk as the call opens",
            )
            raise
        finally:
            self._done(opening)
        first = arrived.chunk
        try:
            auth.check_slot(first.learner_id)
        except auth.AuthError as err:
            await context.abort(err.code, err.details)
        slot = (first.learner_id, first.part if first.parts > 1 else 0)
        await self._enter(
            slot,
            context,
            f"learner slot {slot[0][:64]!r} has {self.max_per_slot} Ingest calls in flight "
            "already (--max-ingest-per-slot); wait for them",
        )
        try:
            return await self._admit(arrived, request_iterator, context)
        except WorkerShutDown:
            # The owner gave the fragment up (its lease lapsed or moved) while this update
            # arrived: the learner sends it to the new owner.
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, NOT_OWNER.format(p=first.header.fragment)
            )
            raise
        finally:
            self._done(slot)

    async def _enter(
        self,
        key: tuple[str, int],
        context: grpc.aio.ServicerContext[Arrived, session_pb2.Ack],
        refusal: str,
    ) -> None:
        """Count one more Ingest call under `key`, or end it (RESOURCE_EXHAUSTED, saying
        `refusal`) while --max-ingest-per-slot calls are counted there already."""
        if self.in_flight[key] >= self.max_per_slot:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        self.in_flight[key] += 1

    def _done(self, key: tuple[str, int]) -> None:
        """One Ingest call counted under `key` ended (or moved on to its slot's count)."""
        self.in_flight[key] -= 1
        if self.in_flight[key] <= 0:
            del self.in_flight[key]

    async def _admit(
        self,
        arrived: Arrived,
        rest: AsyncIterator[Arrived],
        context: grpc.aio.ServicerContext[Arrived, session_pb2.Ack],
    ) -> session_pb2.Ack:
        first = arrived.chunk
        structlog.contextvars.bind_contextvars(
            learner=first.learner_id, fragment=first.header.fragment, seq=first.seq
        )
        layout = self._layout()
        try:
            check_update_fields(first)
            if layout is None:
                raise Rejection(
                    "bad_request",
                    Status.FAILED_PRECONDITION,
                    "the job has no parameter spec yet; a learner must say hello first",
                )
            codec = check_header(first.header, first.kind, first.c_steps, layout)
        except Rejection as rejection:
            return await self._refuse(first, rejection)
        p = first.header.fragment
        owner = self.ownership.owned.get(p)
        if owner is None or owner.lost:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NOT_OWNER.format(p=p))
        assert owner is not None
        if first.kind == session_pb2.UPDATE_KIND_INITIAL and owner.version is not None:
            # Known before a byte of it is read or a buffer made for it (whole or in parts).
            return session_pb2.Ack(
                seq=first.seq,
                fragment=p,
                epoch=owner.epoch,
                status=session_pb2.ACK_STATUS_ALREADY_INITIALIZED,
            )
        try:
            # The replica's shared view of the live learners (read about ten times a
            # second for every update and round), not a read of the store per update: the
            # rounds count members by the same view.
            live = await self.ownership.live.holds(first.learner_id)
        except Exception as err:  # Redis away: the learner sends it again
            log.warning("liveness_unknown", error=repr(err))
            return await self._refuse(
                first,
                Rejection(
                    "bad_request",
                    Status.UNAVAILABLE,
                    "the synchronizer cannot reach its control store to see that the slot's "
                    "session is live; resend later",
                ),
            )
        if not live:
            # Only live learners merge: a round's step is scaled by the live learners it
            # stands for, so an update from a slot nobody counts would take a step alone.
            return await self._refuse(
                first,
                Rejection(
                    "not_live",
                    Status.UNAVAILABLE,
                    f"learner slot {first.learner_id[:64]!r} has no live session: updates "
                    "count only from a learner whose Session said hello and keeps its "
                    "heartbeats; open the session (or wait for it to reconnect) and resend",
                ),
            )
        initializer = self.config.initializer
        if first.kind == session_pb2.UPDATE_KIND_INITIAL and initializer not in (
            "",
            first.learner_id,
        ):
            return await self._refuse(
                first,
                Rejection(
                    "bad_request",
                    Status.PERMISSION_DENIED,
                    f"a fragment's first values come from the job's initializer slot "
                    f"{initializer[:64]!r} (--initializer), not from {first.learner_id[:64]!r}; "
                    "wait for them",
                ),
            )
        if first.parts > 1:
            return await self._in_parts(owner, codec, arrived, rest)
        if first.kind == session_pb2.UPDATE_KIND_INITIAL:
            return await self._initial(owner, arrived, rest)
        return await self._update(owner, codec, arrived, rest)

    async def _chunks(
        self, arrived: Arrived, rest: AsyncIterator[Arrived], waits: Waits
    ) -> AsyncIterator[Arrived]:
        """The call's chunks in order, each checked against the first's header; each next
        one read once the downlink is not behind (`waits.downlink`: how long that took)."""
        first = arrived.chunk
        expected_offset, n = 0, first.header.num_elements
        current: Arrived | None = arrived
        index, received = 0, 0
        while current is not None:
            chunk, data = current
            if index >= first.header.chunk_count:
                raise Rejection(
                    "out_of_order", Status.INVALID_ARGUMENT, "more chunks than announced"
                )
            check_chunk(chunk, first, index, expected_offset, n)
            received += len(data)
            if received > first.header.total_bytes:
                raise Rejection(
                    "shape_mismatch",
                    Status.INVALID_ARGUMENT,
                    f"the chunks hold more than the {first.header.total_bytes} bytes announced",
                )
            yield current
            expected_offset += chunk.value_count
            index += 1
            if self.downlink_caught_up is not None and index < first.header.chunk_count:
                waits.downlink += await self.downlink_caught_up()  # not once all is sent
            current = await anext(rest, None)
        if (
            expected_offset != n
            or index != first.header.chunk_count
            or (received != first.header.total_bytes)
        ):
            raise Rejection(
                "out_of_order",
                Status.INVALID_ARGUMENT,
                f"the update ended after {expected_offset} of {n} values, {received} of "
                f"{first.header.total_bytes} bytes ({index} of {first.header.chunk_count} "
                "chunks); resend it whole",
            )

    async def _update(
        self,
        owner: FragmentOwner,
        codec: codecs.Codec,
        arrived: Arrived,
        rest: AsyncIterator[Arrived],
    ) -> session_pb2.Ack:
        first = arrived.chunk
        if owner.rule.needs_norms and len(first.tensor_norms) != len(owner.segments):
            return await self._refuse(
                first,
                Rejection(
                    "bad_request",
                    Status.INVALID_ARGUMENT,
                    f"the {owner.rule.name} merge needs the norm of each of the fragment's "
                    f"{len(owner.segments)} tensors in the first chunk (tensor_norms)",
                ),
            )
        try:
            update = begin_update(owner, codec, first, list(first.tensor_norms))
        except Rejection as rejection:
            owner.refused(first.learner_id, rejection.reason)
            return await self._refuse(first, rejection)
        summing = Summing()
        clock = time.perf_counter
        waited, mark, waits = 0.0, clock(), Waits()
        try:
            # The next chunk is read while the last ones are summed on the fragment's worker.
            async for chunk, data in self._chunks(arrived, rest, waits):
                began = clock()
                await summing.add(owner.add(update, chunk.value_offset, chunk.value_count, data))
                waited += clock() - began
            began = clock()
            await summing.done()
            waited += clock() - began
            WAIT_READ.observe(clock() - mark - waited - waits.downlink)
            WAIT_SUM.observe(waited)
            WAIT_DOWNLINK.observe(waits.downlink)
            if update.hasher.intdigest() != first.header.checksum:
                raise Rejection(
                    "checksum",
                    Status.INVALID_ARGUMENT,
                    "payload checksum mismatch: bytes were corrupted; resend the update",
                )
            try:
                owner.check_norms(update)
            except NormTooLarge as err:
                raise Rejection("norm", Status.INVALID_ARGUMENT, str(err)) from None
        except Rejection as rejection:
            await summing.drain()
            await owner.abandon(update)
            owner.refused(first.learner_id, rejection.reason)
            return await self._refuse(first, rejection)
        except BaseException:
            await summing.drain()
            await owner.abandon(update)
            raise
        began = clock()
        status, version = await owner.receive(update, first.header.checksum)
        WAIT_RECORD.observe(clock() - began)
        return await self._answer(owner, first, status, version)

    async def _answer(
        self, owner: FragmentOwner, first: session_pb2.UpdateChunk, status: str, version: int
    ) -> session_pb2.Ack:
        """The ack of an update its owner has recorded (or refused to record)."""
        ack = session_pb2.Ack(
            seq=first.seq, fragment=first.header.fragment, version=version, epoch=owner.epoch
        )
        if status in ("received", "again"):
            ack.status = session_pb2.ACK_STATUS_RECEIVED
            return ack
        if status == "duplicate":
            tm.UPDATES_DUPLICATE.inc()
            ack.status = session_pb2.ACK_STATUS_DUPLICATE
            return ack
        if status == "not_owner":
            raise Rejection(
                "bad_request",
                Status.FAILED_PRECONDITION,
                NOT_OWNER.format(p=first.header.fragment),
            )
        reason, code, text = REFUSALS[status]
        message = text.format(
            base=first.base_version,
            version=version,
            max_staleness=self.config.max_staleness,
            p=first.header.fragment,
            seq=first.seq,
            incarnation=first.incarnation[:64],
            learner=first.learner_id[:64],
        )
        return await self._refuse(first, Rejection(reason, code, message), version)

    async def _initial(
        self, owner: FragmentOwner, arrived: Arrived, rest: AsyncIterator[Arrived]
    ) -> session_pb2.Ack:
        first = arrived.chunk
        values = np.empty(owner.size, np.float32)
        hasher = xxhash.xxh3_64()
        try:
            async for chunk, data in self._chunks(arrived, rest, Waits()):
                part = initial_values(data, chunk.value_count)
                values[chunk.value_offset : chunk.value_offset + chunk.value_count] = part
                hasher.update(data)
            if hasher.intdigest() != first.header.checksum:
                raise Rejection("checksum", Status.INVALID_ARGUMENT, "payload checksum mismatch")
        except Rejection as rejection:
            return await self._refuse(first, rejection)
        return await self._take_initial(owner, first, values)

    async def _take_initial(
        self, owner: FragmentOwner, first: session_pb2.UpdateChunk, values: np.ndarray
    ) -> session_pb2.Ack:
        """Make a fragment's whole initial value its first version, unless it has one."""
        ack = session_pb2.Ack(seq=first.seq, fragment=first.header.fragment, epoch=owner.epoch)
        if owner.version is not None:
            ack.status = session_pb2.ACK_STATUS_ALREADY_INITIALIZED
            return ack
        try:
            value, state = await owner.initial_state(values)
        except Exception as err:  # the store is full or away: the learner sends them again
            log.error("tensor_store_write_failed", fragment=owner.fragment, error=repr(err))
            return await self._refuse(
                first,
                Rejection(
                    "bad_request",
                    Status.UNAVAILABLE,
                    f"the synchronizer cannot write to its tensor store ({type(err).__name__}); "
                    "it retries: free space there or fix --tensor-store",
                ),
            )
        if await self.store.init_fragment(owner.fragment, value, state):
            await owner.load(await self.store.pointer(owner.fragment))
            ack.status = session_pb2.ACK_STATUS_ACCEPTED
            log.info("fragment_initialized", fragment=owner.fragment, learner=first.learner_id)
        else:
            await owner.tensors.delete([value, *state])
            await owner.load(await self.store.pointer(owner.fragment))
            ack.status = session_pb2.ACK_STATUS_ALREADY_INITIALIZED
        return ack

    async def _in_parts(
        self,
        owner: FragmentOwner,
        codec: codecs.Codec,
        arrived: Arrived,
        rest: AsyncIterator[Arrived],
    ) -> session_pb2.Ack:
        """One part of an update from a learner of several processes (synchronizer/parts.py)."""

        async def finish(gathering: Gathering) -> session_pb2.Ack:
            whole = gathering.first
            if gathering.update is None:
                assert gathering.values is not None
                return await self._take_initial(owner, whole, gathering.values)
            checksum = combined_checksum(gathering.arrived)
            status, version = await owner.receive(gathering.update, checksum)
            try:
                return await self._answer(owner, whole, status, version)
            except Rejection as rejection:  # not the owner now: again, to the new one
                raise Rejection(rejection.reason, Status.UNAVAILABLE, rejection.message) from None

        try:
            return await self.parts.admit(owner, codec, arrived, rest, finish)
        except Rejection as rejection:
            return await self._refuse(arrived.chunk, rejection, whole=False)

    async def _refuse(
        self,
        chunk: session_pb2.UpdateChunk,
        rejection: Rejection,
        version: int = 0,
        *,
        whole: bool = True,
    ) -> session_pb2.Ack:
        """The ack refusing an update. A part refused before its update's parts gathered
        (`whole`) fails the update now, its other parts answered with the same refusal."""
        if whole and chunk.parts > 1:
            await self.parts.fail_open(chunk, rejection)
        tm.UPDATES_REJECTED.labels(reason=rejection.reason).inc()
        # The metric has it; the job's total misses one while Redis is away.
        with contextlib.suppress(Exception):
            await self.store.add_stats(updates_rejected=1)
        log.info(
            "update_rejected",
            learner=chunk.learner_id,
            seq=chunk.seq,
            fragment=chunk.header.fragment,
            reason=rejection.reason,
            detail=rejection.message,
        )
        return session_pb2.Ack(
            seq=chunk.seq,
            fragment=chunk.header.fragment,
            status=session_pb2.ACK_STATUS_REJECTED,
            code=int(rejection.code),
            reason=rejection.message,
            version=version,
        )
