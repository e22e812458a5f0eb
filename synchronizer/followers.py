"""New global values, from each fragment's owner to the learners that follow it.

A learner follows every replica of its owner map (a Follow call each). A replica watches the
versions of the fragments it owns and brings every follower up to date from the tensor
store: the encoded deltas since the version the follower holds, or the whole value for one
too far behind. So a fragment's values come back the way its updates go, straight from its
owner: each replica reads and frames only its own fragments' deltas, and a learner takes
them in over as many streams as there are replicas.

How far behind the followers are (bytes queued to them) holds uploads back (`Downlink`): a
replica takes updates in no faster than it hands the values they make back out.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from services import codec as codecs
from services import telemetry as tm
from services.gen.atoll.v1 import fragment_pb2, session_pb2, synchronizer_pb2
from services.layout import FragmentLayout
from services.outage import OutageLog, every
from services.wire import bytes_field, join_field, segments_header
from synchronizer import auth
from synchronizer.core import admission
from synchronizer.core.admission import Rejection
from synchronizer.fetch import value_layout
from synchronizer.ownership import Ownership
from synchronizer.refusals import grpc_status
from synchronizer.session import OUTBOX_LIMIT, WATCH_S
from synchronizer.store.control import ControlStore
from synchronizer.store.tensors import TensorStore
from synchronizer.values import RebuiltValues, float32_bytes

log = structlog.get_logger("atoll.synchronizer.followers")

# Uploads wait while most of this replica's followers have more than this many bytes of
# global fragments queued to them: a replica takes updates in no faster than it can hand the
# values they make back out (each merge's delta goes to every learner). Without it a busy
# replica reads uploads and leaves the downlink to pile up, until learners train on stale
# values or their streams overflow (OUTBOX_LIMIT).
DOWNLINK_BACKLOG_BYTES = 256 << 20
DOWNLINK_WAIT_MAX_S = 5.0  # an upload's chunk waits no longer than this
# A follower whose queue has not moved for this long is not reading (paused, stuck): it holds
# no upload back (its queue grows until OUTBOX_LIMIT ends its stream).
DOWNLINK_STALLED_S = 2.0
MAX_DELTA_CHAIN = 8  # deltas sent to catch a learner up before a whole value is cheaper
# A follower not reading is ended once this many bytes are queued to it, or twice the whole
# values of the fragments this replica owns if that is more (what a follower that joins is
# sent at once): the deltas of every merge since it stopped reading stay in memory for it
# until then (OUTBOX_LIMIT counts messages, each up to a chunk of a MiB or more).
FOLLOWER_BACKLOG_MIN_BYTES = 1 << 30
# A learner follows each replica once, and once more while a call it broke is still ending
# here: a slot's newer calls end its oldest, so that one slot's calls, however many
# connections they come on, hold at most this many queues of whole values on a replica.
MAX_FOLLOWS_PER_SLOT = 2
SUPERSEDED_END_S = 5.0


@dataclass
class Follower:
    """One Follow call: the serialized chunks queued to it, and what it was sent."""

    sent_versions: dict[int, int] = field(default_factory=dict)
    outbox: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    queued_bytes: int = 0  # serialized fragment chunks in the outbox, not yet sent
    drained_at: float = field(default_factory=time.monotonic)  # when they last moved
    task: asyncio.Task[Any] | None = None  # the call's handler, ended if it falls too far
    ended: bool = False
    slot: str = ""  # the learner slot following
    superseded: bool = False  # ended by a newer call of its slot: it ends ABORTED

    def end(self, *, superseded: bool = False) -> None:
        """End the call, and let go of what was queued to it now (not once its stream moves
        again): cancelled at once, or, `superseded`, with ABORTED as soon as its stream
        moves (cancelled if it has not within SUPERSEDED_END_S: a learner not reading)."""
        self.ended = True
        while not self.outbox.empty():
            self.outbox.get_nowait()
        self.queued_bytes = 0
        if self.task is None:
            return
        if superseded:
            self.superseded = True
            self.outbox.put_nowait(None)
            asyncio.get_running_loop().call_later(SUPERSEDED_END_S, self.task.cancel)
        else:
            self.task.cancel()

    def send(self, message: bytes, limit_bytes: int = FOLLOWER_BACKLOG_MIN_BYTES) -> None:
        """Queue one serialized message, unless the call is over OUTBOX_LIMIT messages or
        `limit_bytes` behind (it then ends)."""
        if self.ended:
            return
        over_bytes = self.queued_bytes and self.queued_bytes + len(message) > limit_bytes
        if self.outbox.qsize() > OUTBOX_LIMIT or over_bytes:
            # It does not read (a learner blocked, or one that never reads): the call ends.
            # The learner follows again from the values it holds.
            log.warning(
                "follower_too_slow",
                queued=self.outbox.qsize(),
                queued_bytes=self.queued_bytes,
                learner=self.slot[:64],
            )
            self.end()
            return
        if not self.queued_bytes:
            self.drained_at = time.monotonic()  # the queue starts moving from now
        self.queued_bytes += len(message)
        self.outbox.put_nowait(message)


def backlog_limit(owned_values: int, floor: int = FOLLOWER_BACKLOG_MIN_BYTES) -> int:
    """Bytes queued to a follower before it counts as not reading: `floor`, or twice the
    float32 values of the fragments this replica owns (`owned_values` of them), whole values
    being the most a follower is sent at once."""
    return max(floor, 2 * 4 * owned_values)


def most_behind(
    queues: list[tuple[int, float]],
    now: float,
    mark: int = DOWNLINK_BACKLOG_BYTES,
    stalled_s: float = DOWNLINK_STALLED_S,
) -> bool:
    """Whether most followers are over `mark` bytes behind: the lower median of the bytes
    queued to each, given as (bytes, when its queue last moved), of those reading (a queue
    that has not moved for `stalled_s` is a learner not reading: it does not count)."""
    ordered = sorted(b for b, moved in queues if not b or now - moved < stalled_s)
    return bool(ordered) and ordered[(len(ordered) - 1) // 2] > mark


class Downlink:
    """How far behind on global fragments a replica's followers are (bytes queued to them),
    and the wait for them to catch up before an upload reads on."""

    def __init__(self, followers: dict[int, Follower]) -> None:
        self.followers = followers  # the replica's Follow calls, as they come and go
        self._moved = asyncio.Event()  # set as fragment chunks leave an outbox

    def sent(self, follower: Follower, nbytes: int) -> None:
        """A serialized fragment chunk of `nbytes` left `follower`'s outbox for the wire."""
        follower.queued_bytes -= nbytes
        follower.drained_at = time.monotonic()
        self._moved.set()

    def moved(self) -> None:
        """The queues changed otherwise (a follower left): waiting uploads look again."""
        self._moved.set()

    async def caught_up(self) -> float:
        """Wait, at most DOWNLINK_WAIT_MAX_S, until most of this replica's reading followers
        (`most_behind`: one slow learner alone holds no upload back, one not reading at all
        does not count) have at most DOWNLINK_BACKLOG_BYTES of fragments queued to them; the
        seconds waited. An upload's next chunk is read only then (`Ingest`), so HTTP/2 flow
        control slows the learners' uploads while the replica sends the values their merges
        made."""
        began = now = time.monotonic()
        while True:
            queues = [
                (f.queued_bytes, f.drained_at) for f in self.followers.values() if not f.ended
            ]
            left = DOWNLINK_WAIT_MAX_S - (now - began)
            if left <= 0 or not most_behind(queues, now):
                return now - began
            # Woken as queues move, or when the next one would count as stalled.
            stalls = [
                moved + DOWNLINK_STALLED_S - now
                for queued, moved in queues
                if queued and moved + DOWNLINK_STALLED_S > now
            ]
            self._moved.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), min([left, *stalls]))
            now = time.monotonic()


# Where a pushed chunk's bytes go: SynchronizerMessage.fragment, GlobalFragmentChunk.data.
FRAGMENT_FIELD = session_pb2.SynchronizerMessage.DESCRIPTOR.fields_by_name["fragment"].number
CHUNK_DATA_FIELD = fragment_pb2.GlobalFragmentChunk.DESCRIPTOR.fields_by_name["data"].number


def pushed_chunks(
    header: fragment_pb2.PayloadHeader,
    version: int,
    pieces: Iterable[tuple[int, int, codecs.Payload]],
    **fields: Any,
) -> list[tuple[int, bytes]]:
    """Each (value offset, value count, bytes) of a payload as a pushed SynchronizerMessage
    of `version`, with the chunk's `fields` besides, and the version it brings: serialized
    with its bytes copied once, where protobuf copies them into the chunk, into the message
    and into its serialization (a large model's fragment is tens of MB, and every merge's
    delta is pushed)."""
    out = []
    for i, (offset, count, data) in enumerate(pieces):
        head = fragment_pb2.GlobalFragmentChunk(
            header=header,
            version=version,
            chunk_index=i,
            value_offset=offset,
            value_count=count,
            **fields,
        ).SerializeToString()
        parts = join_field(head, CHUNK_DATA_FIELD, data)
        out.append((version, b"".join(bytes_field(FRAGMENT_FIELD, parts))))
    return out


def delta_messages(
    fragment: int,
    version: int,
    blob: codecs.Payload,
    codec: codecs.Codec,
    block_size: int,
    n: int,
) -> list[tuple[int, bytes]]:
    """A stored delta as pushed messages, one a segment (`pushed_chunks`)."""
    segments = codecs.unpack_segments(blob)
    header = segments_header(fragment, codec.wire, block_size, n, segments)
    pieces = ((s.offset, s.count, s.data) for s in segments)
    return pushed_chunks(header, version, pieces, delta=True, base_version=version - 1)


def value_messages(
    fragment: int, version: int, values: bytes | memoryview, chunk_bytes: int
) -> list[tuple[int, bytes]]:
    """A whole float32 value as pushed messages, one a segment (`pushed_chunks`): built from
    `value_chunks` instead, it was held several times its size at once."""
    header, spans = value_layout(fragment, values, chunk_bytes)
    pieces = ((start, stop - start, values[4 * start : 4 * stop]) for start, stop in spans)
    return pushed_chunks(header, version, pieces)


class Followers:
    """The learners following this replica, and the new values of what it owns, to them."""

    def __init__(
        self,
        job: str,
        downlink_codec: str,
        block_size: int,
        max_chunk_bytes: int,
        store: ControlStore,
        tensors: TensorStore,
        ownership: Ownership,
        rebuilt: RebuiltValues,
        layout: Callable[[], FragmentLayout | None],
    ) -> None:
        self.job, self.codec = job, codecs.by_name(downlink_codec)
        self.block_size, self.max_chunk_bytes = block_size, max_chunk_bytes
        self.store, self.tensors, self.ownership = store, tensors, ownership
        self.rebuilt, self._layout = rebuilt, layout
        self.followers: dict[int, Follower] = {}
        self.downlink = Downlink(self.followers)
        self._ids = itertools.count()

    async def Follow(
        self,
        request: synchronizer_pb2.FollowRequest,
        context: grpc.aio.ServicerContext[
            synchronizer_pb2.FollowRequest, session_pb2.SynchronizerMessage
        ],
    ) -> AsyncIterator[bytes]:
        """A learner's stream of new values of the fragments this replica owns (serialized
        once for every follower they go to: the handler passes bytes as they are)."""
        key = next(self._ids)  # the order calls came in: a slot's oldest are ended first
        try:
            admission.check_job(request.job, self.job)
        except Rejection as rejection:
            await context.abort(*grpc_status(rejection))
        # A learner older than this replica names no slot: the one its credential names.
        slot = request.learner_id or auth.CALLER.get().only_slot or ""
        if not slot or len(slot) > admission.MAX_NAME_CHARS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a Follow call names the learner slot following (learner_id, at most "
                f"{admission.MAX_NAME_CHARS} chars); a learner older than this replica "
                "does not: upgrade it",
            )
        auth.check_slot(slot)
        layout = self._layout()
        if layout is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the job has no global parameters yet; a learner must join first (retrying)",
            )
        assert layout is not None
        fragments = layout.num_fragments
        try:
            admission.check_fragments_named("follow", fragments, [request.held], request.held)
        except Rejection as rejection:
            await context.abort(*grpc_status(rejection))
        # A fragment is followed from the version held, or from its current version (the
        # learner fetches that itself). A held version past the current one is none the job
        # made: it is followed from the current one too.
        current = [v or 0 for v in await self.store.versions(fragments)]
        sent = {
            p: int(request.held[p]) if request.held.get(p, current[p] + 1) <= current[p] else v
            for p, v in enumerate(current)
        }
        follower = Follower(sent_versions=sent, task=asyncio.current_task(), slot=slot)
        self.followers[key] = follower
        self._supersede(slot)
        tm.FOLLOWERS.set(len(self.followers))
        try:
            while True:
                item = await follower.outbox.get()
                if item is None:
                    if follower.superseded:
                        await context.abort(
                            grpc.StatusCode.ABORTED,
                            f"{MAX_FOLLOWS_PER_SLOT} newer Follow calls of learner slot "
                            f"{follower.slot[:64]!r} took this one's place",
                        )
                    return
                self.downlink.sent(follower, len(item))
                yield item
        finally:
            del self.followers[key]
            tm.FOLLOWERS.set(len(self.followers))
            self.downlink.moved()  # its outbox counts no more: waiting uploads look again

    def _supersede(self, slot: str) -> None:
        """`slot`'s oldest calls past its newest MAX_FOLLOWS_PER_SLOT end (ABORTED), their
        queues let go now."""
        calls = [f for _, f in sorted(self.followers.items()) if f.slot == slot and not f.ended]
        for follower in calls[: max(0, len(calls) - MAX_FOLLOWS_PER_SLOT)]:
            log.info("follower_superseded", learner=slot[:64])
            follower.end(superseded=True)

    def close(self) -> None:
        """End every Follow call (the replica drains)."""
        for follower in self.followers.values():
            follower.outbox.put_nowait(None)

    # --- keeping followers up to date -----------------------------------------------------
    async def watch_forever(self) -> None:
        """Follow the versions of the fragments this replica owns; bring followers up."""
        outage = OutageLog(log, "follow_watch_interrupted", "follow_watch_resumed")
        await every(WATCH_S, self.watch, outage)

    async def watch(self) -> None:
        layout = self._layout()
        if layout is None or not self.followers:
            return
        owned = sorted(self.ownership.owned)
        versions = await self.store.versions(layout.num_fragments)
        limit = backlog_limit(sum(layout.fragments[p].num_elements for p in owned))
        for p in owned:
            version = versions[p]
            if version is not None:
                await self._push(p, version, layout, limit)
        # What other replicas own their owners push: taken as sent, so that a fragment this
        # replica takes over later goes on from there (a learner that missed a version then
        # finds a delta that does not follow its values, and fetches the fragment), not
        # whole to every follower.
        for p, version in enumerate(versions):
            if version is not None and p not in self.ownership.owned:
                for follower in self.followers.values():
                    if follower.sent_versions.get(p, -1) < version:
                        follower.sent_versions[p] = version

    async def _push(
        self, fragment: int, version: int, layout: FragmentLayout, limit_bytes: int
    ) -> None:
        """Bring every follower to the fragment's newest version: the encoded deltas since
        the version it was last sent, or the whole value (a follower `limit_bytes` behind
        is ended instead: `Follower.send`)."""
        # Each read only if someone needs it, and serialized once for all: followers share
        # the bytes (a whole value is the model's size; one copy per learner would not fit).
        full: list[tuple[int, bytes]] = []
        deltas: dict[int, list[tuple[int, bytes]] | None] = {}
        sent = [
            (f, f.sent_versions.get(fragment, -1))
            for f in list(self.followers.values())
            if not f.ended  # its call ends: nothing more is read or framed for it
        ]
        behind = [(f, last) for f, last in sent if last < version]

        def by_deltas(last: int) -> bool:
            return last >= 0 and version - last <= MAX_DELTA_CHAIN

        # The commit log since the oldest version a follower catches up from by deltas,
        # read once for all of them.
        chained = [last for _, last in behind if by_deltas(last)]
        entries = (
            {
                int(e["version"]): e
                for e in await self.store.log_range(fragment, min(chained), version)
            }
            if chained
            else {}
        )
        for follower, last in behind:
            chunks: list[tuple[int, bytes]] = []
            if by_deltas(last):
                for v in range(last + 1, version + 1):
                    if v not in deltas:
                        # Read, parsed and serialized once for every follower (off the
                        # event loop: a large model's delta is tens of MB). Only this
                        # task pushes, so no newer push to this fragment runs meanwhile.
                        deltas[v] = await self._delta(fragment, v, entries.get(v), layout)
                    serialized = deltas[v]
                    if serialized is None:  # no longer kept: the whole value instead
                        chunks = []
                        break
                    chunks += serialized
            if not chunks:
                full = full or await self._whole_value(fragment)
                chunks = full
            follower.sent_versions[fragment] = max(version, chunks[0][0])
            for _, data in chunks:
                follower.send(data, limit_bytes)

    async def _delta(
        self, fragment: int, version: int, entry: dict[str, Any] | None, layout: FragmentLayout
    ) -> list[tuple[int, bytes]] | None:
        """A version's delta as serialized messages (None: no longer kept)."""
        if entry is None or not entry.get("delta"):
            return None
        try:
            blob = await self.tensors.get(str(entry["delta"]))
        except Exception:
            return None
        n = layout.fragments[fragment].num_elements
        return await asyncio.to_thread(
            delta_messages, fragment, version, blob, self.codec, self.block_size, n
        )

    async def _whole_value(self, fragment: int) -> list[tuple[int, bytes]]:
        """The fragment's whole current value as serialized messages, for every follower
        that needs it."""
        version, value = await self.rebuilt.get(self.store, self.tensors, fragment)
        return await asyncio.to_thread(  # copies the whole value: off the event loop
            value_messages, fragment, version, float32_bytes(value), self.max_chunk_bytes
        )
