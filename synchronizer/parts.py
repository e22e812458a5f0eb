"""Updates that arrive in parts: one per process of a learner that spans several hosts.

Each process sends the values it holds of a fragment on its own Ingest call
(`UpdateChunk.part` of `parts`, all with the update's seq and counters), so no process ever
gathers the whole fragment. The owner sums every part's chunks into the one update as they
arrive, exactly as it sums a whole update's, and records the update as received once every
part is in and the parts together cover the fragment exactly; then it answers every part's
call with the same ack. Refused, each with its reason: a chunk overlapping values already
in (from any part), parts that disagree on the update's counters, parts that leave a gap,
and every check a whole update gets (header, codec, checksum per part, norm bound, finite
values). When the last part has not come `timeout_s` after the first, the update is
abandoned: its sums are taken out and every part is refused as retryable (UNAVAILABLE), so
the learner's processes send it again.

A part that fails fails the whole update (the round's sum cannot take one part out alone);
every part is answered with that refusal. A final answer (received, duplicate, refused for
good) is kept for a while, so a part sent again after its call broke gets it too.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from services import codec as codecs
from services.gen.atoll.v1 import session_pb2
from synchronizer.core.admission import (
    Arrived,
    Rejection,
    Status,
    check_part_chunk,
    check_parts,
    check_same_update,
    codec_refusal,
    initial_values,
)
from synchronizer.owner import FragmentOwner
from synchronizer.records import NormTooLarge, RoundBusy, Update

SUMMING_AHEAD = 3  # chunks of one update queued on the fragment's worker while more arrive
KEEP_ANSWERS = 4096  # final answers kept for parts sent again
# Updates in parts one slot may have open on one fragment (its round's update and a retry):
# each holds a fragment's worth of chunks or values until its parts are in or time out.
OPEN_PER_SLOT = 2


@dataclass
class Coverage:
    """The value ranges of a fragment claimed so far: sorted, disjoint, adjacent ones
    joined."""

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    total: int = 0

    def claim(self, offset: int, count: int) -> bool:
        """Claim values [offset, offset + count); False (nothing claimed) if any is taken."""
        end = offset + count
        i = bisect_right(self.starts, offset)
        if (i and self.ends[i - 1] > offset) or (i < len(self.starts) and self.starts[i] < end):
            return False
        self.total += count
        joins_left = bool(i) and self.ends[i - 1] == offset
        joins_right = i < len(self.starts) and self.starts[i] == end
        if joins_left and joins_right:
            self.ends[i - 1] = self.ends[i]
            del self.starts[i], self.ends[i]
        elif joins_left:
            self.ends[i - 1] = end
        elif joins_right:
            self.starts[i] = offset
        else:
            self.starts.insert(i, offset)
            self.ends.insert(i, end)
        return True


def combined_checksum(parts: dict[int, int]) -> int:
    """The update's checksum as its idempotency record keeps it: XXH3-64 of its parts'
    checksums in part order (a retry must send the same bytes in every part)."""
    packed = np.array([parts[k] for k in sorted(parts)], "<u8").tobytes()
    return xxhash.xxh3_64_intdigest(packed)


@dataclass(eq=False)
class Gathering:
    """One update whose parts are coming in."""

    first: session_pb2.UpdateChunk  # the first chunk of the first part to arrive
    owner: FragmentOwner
    update: Update | None  # an outer gradient's sums
    values: np.ndarray | None  # initial values, placed as they arrive
    coverage: Coverage = field(default_factory=Coverage)
    arrived: dict[int, int] = field(default_factory=dict)  # part -> its checksum
    sending: set[int] = field(default_factory=set)
    answer: asyncio.Future[session_pb2.Ack | Rejection] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    started: float = field(default_factory=time.monotonic)
    watchdog: asyncio.Task[None] | None = None

    @property
    def refusal(self) -> Rejection | None:
        """The update's refusal, once refused."""
        if self.answer.done() and isinstance(self.answer.result(), Rejection):
            return self.answer.result()  # type: ignore[return-value]
        return None


Key = tuple[int, int, str, str, int]  # fragment, owner epoch, learner, incarnation, seq
Finish = Callable[[Gathering], Awaitable[session_pb2.Ack]]


@dataclass(frozen=True)
class Answer:
    """A final answer kept for parts sent again: the ack, or the refusal, and the checksum
    each part had."""

    result: session_pb2.Ack | Rejection
    checksums: dict[int, int]


class Parts:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.open: dict[Key, Gathering] = {}
        self.answers: OrderedDict[Key, Answer] = OrderedDict()

    async def admit(
        self,
        owner: FragmentOwner,
        codec: codecs.Codec,
        arrived: Arrived,
        rest: AsyncIterator[Arrived],
        finish: Finish,
    ) -> session_pb2.Ack:
        """Take one part (its first chunk and the rest of its call); return the update's
        ack once every part is in. `finish` records the whole update (called once). Raises
        the Rejection that refuses this part (and, but for a duplicate, the update)."""
        first = arrived.chunk
        outer = first.kind == session_pb2.UPDATE_KIND_OUTER_GRADIENT
        whole_only = outer and not owner.rule.sums_in_parts
        check_parts(first, owner.size, owner.rule.name if whole_only else None)
        key = (owner.fragment, owner.epoch, first.learner_id, first.incarnation, first.seq)
        kept = self.answers.get(key)
        if kept is not None:
            return _kept(kept, first)
        gathering = self.open.get(key)
        if gathering is None:
            fragment, _, slot = key[:3]
            if sum(1 for k in self.open if k[0] == fragment and k[2] == slot) >= OPEN_PER_SLOT:
                raise Rejection(
                    "bad_request",
                    Status.UNAVAILABLE,
                    f"learner slot {slot[:64]!r} has {OPEN_PER_SLOT} updates in parts open on "
                    f"fragment {fragment} already; wait for their answers",
                )
            gathering = self._open(key, owner, codec, first)
        else:
            check_same_update(first, gathering.first)
            if first.part in gathering.sending or first.part in gathering.arrived:
                raise Rejection(
                    "bad_request",
                    Status.UNAVAILABLE,
                    f"part {first.part} of update {first.seq} is being received already; "
                    "wait for its answer",
                )
        gathering.sending.add(first.part)
        try:
            checksum = await self._receive(gathering, codec, arrived, rest)
        except Rejection as rejection:
            await self._fail(key, gathering, rejection)
            raise
        except BaseException as err:
            await self._fail(
                key,
                gathering,
                Rejection(
                    "bad_request",
                    Status.UNAVAILABLE,
                    f"part {first.part} of update {first.seq} broke off ({type(err).__name__}); "
                    "send every part again",
                ),
            )
            raise
        finally:
            gathering.sending.discard(first.part)
        gathering.arrived[first.part] = checksum
        if len(gathering.arrived) == first.parts and gathering.refusal is None:
            # Recorded even if this call is cancelled meanwhile: the other parts wait for it.
            await asyncio.shield(asyncio.ensure_future(self._complete(key, gathering, finish)))
        result = await asyncio.shield(gathering.answer)
        if isinstance(result, Rejection):
            raise result
        return result

    def _open(
        self, key: Key, owner: FragmentOwner, codec: codecs.Codec, first: session_pb2.UpdateChunk
    ) -> Gathering:
        update, values = None, None
        if first.kind == session_pb2.UPDATE_KIND_OUTER_GRADIENT:
            update = begin_update(owner, codec, first, ())  # a part knows its share only
        else:
            values = np.empty(owner.size, np.float32)
        gathering = Gathering(first, owner, update, values)
        gathering.watchdog = asyncio.create_task(self._expire(key, gathering))
        self.open[key] = gathering
        return gathering

    async def _receive(
        self,
        gathering: Gathering,
        codec: codecs.Codec,
        arrived: Arrived,
        rest: AsyncIterator[Arrived],
    ) -> int:
        """Sum (or place) one part's chunks; return its checksum, checked."""
        first = arrived.chunk
        header, size, update = first.header, gathering.owner.size, gathering.update
        hasher = xxhash.xxh3_64()
        summing = Summing()
        current: Arrived | None = arrived
        index, after, received = 0, 0, 0
        try:
            while current is not None:
                chunk, data = current
                refusal = gathering.refusal
                if refusal is not None:
                    raise refusal
                if index >= header.chunk_count:
                    raise _invalid("out_of_order", "more chunks than announced")
                check_part_chunk(chunk, first, index, after, size)
                received += len(data)
                if received > header.total_bytes:
                    raise _invalid(
                        "shape_mismatch",
                        f"the part's chunks hold more than the {header.total_bytes} bytes "
                        "announced",
                    )
                offset, count = int(chunk.value_offset), int(chunk.value_count)
                if not gathering.coverage.claim(offset, count):
                    raise _invalid(
                        "shape_mismatch",
                        f"part {first.part} sends values {offset}..{offset + count - 1}, some of "
                        "which another chunk of this update already sent; the parts must not "
                        "overlap",
                    )
                hasher.update(data)
                if update is not None:
                    await summing.add(gathering.owner.add(update, offset, count, data))
                else:
                    assert gathering.values is not None
                    gathering.values[offset : offset + count] = initial_values(data, count)
                after, index = offset + count, index + 1
                current = await anext(rest, None)
            await summing.done()
        finally:
            await summing.drain()
        if index != header.chunk_count or received != header.total_bytes:
            raise _invalid(
                "out_of_order",
                f"part {first.part} ended after {index} of {header.chunk_count} chunks, "
                f"{received} of {header.total_bytes} bytes; resend it whole",
            )
        if hasher.intdigest() != header.checksum:
            raise _invalid(
                "checksum", f"part {first.part}'s checksum mismatch: bytes were corrupted"
            )
        return hasher.intdigest()

    async def _complete(self, key: Key, gathering: Gathering, finish: Finish) -> None:
        size = gathering.owner.size
        if gathering.coverage.total != size:
            await self._fail(
                key,
                gathering,
                _invalid(
                    "shape_mismatch",
                    f"the {len(gathering.arrived)} parts hold {gathering.coverage.total} of "
                    f"the fragment's {size} values; together they must cover it exactly",
                ),
            )
            return
        try:
            ack = await finish(gathering)
        except Rejection as rejection:
            await self._fail(key, gathering, rejection)
            return
        except BaseException:
            await self._fail(key, gathering, _retry("was not recorded"))
            raise
        self._settle(key, gathering, ack)

    def _settle(self, key: Key, gathering: Gathering, result: session_pb2.Ack | Rejection) -> None:
        if gathering.answer.done():
            return
        gathering.answer.set_result(result)
        if self.open.get(key) is gathering:
            del self.open[key]
        if gathering.watchdog is not None and gathering.watchdog is not asyncio.current_task():
            gathering.watchdog.cancel()
        retryable = isinstance(result, Rejection) and result.code == Status.UNAVAILABLE
        if not retryable:
            self.answers[key] = Answer(result, dict(gathering.arrived))
            while len(self.answers) > KEEP_ANSWERS:
                self.answers.popitem(last=False)

    async def _fail(self, key: Key, gathering: Gathering, rejection: Rejection) -> None:
        """Refuse the whole update: take its sums out, answer every part."""
        if gathering.answer.done():
            return
        self._settle(key, gathering, rejection)
        if gathering.update is not None:
            await gathering.owner.abandon(gathering.update)

    async def _expire(self, key: Key, gathering: Gathering) -> None:
        await asyncio.sleep(self.timeout_s)
        if len(gathering.arrived) == gathering.first.parts:
            return  # all in: being recorded
        missing = sorted(set(range(gathering.first.parts)) - set(gathering.arrived))
        await self._fail(
            key,
            gathering,
            _retry(f"lacked parts {missing} {self.timeout_s:g} s after its first came"),
        )

    async def fail_open(self, chunk: session_pb2.UpdateChunk, rejection: Rejection) -> None:
        """A part refused before it reached its update (its header, its fields, its slot's
        session): the update it belongs to, if its other parts are in, is refused with it at
        once, every part answered, rather than left waiting for it until the timeout."""
        wanted = (chunk.header.fragment, chunk.learner_id, chunk.incarnation, chunk.seq)
        for key, gathering in list(self.open.items()):
            if (key[0], key[2], key[3], key[4]) == wanted:
                await self._fail(key, gathering, rejection)

    def close(self) -> None:
        for gathering in self.open.values():
            if gathering.watchdog is not None:
                gathering.watchdog.cancel()


def _kept(kept: Answer, part: session_pb2.UpdateChunk) -> session_pb2.Ack:
    """The kept answer, to a part sent again: the same, if its bytes are the same."""
    if isinstance(kept.result, Rejection):
        raise kept.result
    if kept.checksums.get(part.part) != part.header.checksum:
        raise Rejection(
            "checksum",
            Status.INVALID_ARGUMENT,
            f"part {part.part} of update {part.seq} was received before with other bytes; a "
            "retry must resend the same update",
        )
    return kept.result


def _invalid(reason: str, message: str) -> Rejection:
    return Rejection(reason, Status.INVALID_ARGUMENT, message)


def _retry(what: str) -> Rejection:
    return Rejection(
        "bad_request",
        Status.UNAVAILABLE,
        f"the update in parts {what}; it was abandoned: send every part again",
    )


def begin_update(
    owner: FragmentOwner,
    codec: codecs.Codec,
    first: session_pb2.UpdateChunk,
    norms: Sequence[float],
) -> Update:
    """Start summing the update (or part) whose first chunk is `first` into the owner's
    open round; its refusal as a Rejection."""
    try:
        return owner.begin(
            learner=first.learner_id,
            incarnation=first.incarnation,
            seq=first.seq,
            base_version=first.base_version,
            c_steps=first.c_steps,
            c_tokens=first.c_tokens,
            compute_seconds=first.compute_seconds,
            norms=norms,
            codec=codec,
            block_size=first.header.block_size,
        )
    except NormTooLarge as err:
        raise Rejection("norm", Status.INVALID_ARGUMENT, str(err)) from None
    except RoundBusy as err:  # retryable: the learner's client sends it again later
        raise Rejection("bad_request", Status.UNAVAILABLE, str(err)) from None


class Summing:
    """Chunk sums queued on a fragment's worker while the next chunks are read, at most
    SUMMING_AHEAD at once; a refusal of one is the update's."""

    def __init__(self) -> None:
        self.jobs: deque[asyncio.Future[None]] = deque()

    async def add(self, job: asyncio.Future[None]) -> None:
        self.jobs.append(job)
        if len(self.jobs) >= SUMMING_AHEAD:
            await summed(self.jobs.popleft())

    async def done(self) -> None:
        """Wait for every queued sum; raise the first refusal."""
        while self.jobs:
            await summed(self.jobs.popleft())

    async def drain(self) -> None:
        """Let the sums still queued finish (or fail) before the update is taken out."""
        await asyncio.gather(*self.jobs, return_exceptions=True)
        self.jobs.clear()


async def summed(job: asyncio.Future[None]) -> None:
    """Wait for one chunk's sum; its refusal as the update's."""
    try:
        await job
    except codecs.CodecError as err:
        raise codec_refusal(err) from None
    except NormTooLarge as err:
        raise Rejection("norm", Status.INVALID_ARGUMENT, str(err)) from None
