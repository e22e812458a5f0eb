"""The sums of a fragment's rounds: chunks decoded and added as they arrive, updates taken
out again, provisional updates summed apart, chunks moved to the next round at sealing.

Every sum is touched on the fragment's worker thread only, one job at a time (compiled
kernels release the GIL, so the next chunk arrives meanwhile); which round an update
belongs to (`update.accumulator`) changes on the event loop only. A chunk is summed into
the round its update belongs to when its job runs, and its record says which that was.
Chunks of one range queued together are summed in one pass that reads and writes the sum
once for all of them (`_add_many`), leaving the bits those chunks one after another leave.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from services import codec as codecs
from services.config import JobConfig
from services.lifecycle import usable_cores
from synchronizer.core.admission import others_norm, update_weight
from synchronizer.core.merge import MergeRule, RoundSum, capped_weights
from synchronizer.core.recent import Recent
from synchronizer.records import Chunk, NormTooLarge, Update
from synchronizer.worker import FragmentWorker

# A fragment's outer steps and the sums that run side by side share one pool, a thread per
# core the replica may run on (read once: the pool and the ranges it is given agree).
STEP_THREADS = usable_cores()
STEP_POOL = ThreadPoolExecutor(max_workers=STEP_THREADS, thread_name_prefix="atoll-step")
MAX_WEIGHTED_VALUE = 1e37  # weight x value beyond this would overflow the float32 sum

# The values of an update read for its agreement with the fragment's last merged outer
# gradient and with the fragment's own values (`RoundSums.agreement`).
AGREEMENT_SAMPLE = 1 << 18
# The sample is read as windows of this many values (whole blocks of every blockwise codec
# at the block sizes in use), drawn at random over the update: decoding only them costs a
# few hundred microseconds where decoding its whole chunks cost more than its summing.
AGREEMENT_WINDOW = 1 << 14
_RANDOM = random.SystemRandom()  # which chunks are read: nothing a sender can predict

Range = tuple[int, int, int, str, int]  # sum, offset, count, codec, block size


def _apart(ranges: list[Range]) -> bool:
    """Whether ranges of one sum, each different, share no value: summing them in any
    order gives the same bits."""
    ends: dict[int, int] = {}
    for target, offset, count, _, _ in sorted(ranges, key=lambda r: (r[0], r[1])):
        if offset < ends.get(target, 0):
            return False
        ends[target] = offset + count
    return True


def _ascending(chunks: list[tuple[int, Update, codecs.Segment, RoundSum]]) -> bool:
    """Whether each update's chunks came in ascending order of their values."""
    last: dict[int, int] = {}
    for _, update, segment, _ in chunks:
        if segment.offset < last.get(id(update), -1):
            return False
        last[id(update)] = segment.offset
    return True


def each_chunk(fn: Callable[[Chunk], None], chunks: list[Chunk]) -> None:
    """`fn` on each of one update's chunks, side by side on the step pool: they are
    disjoint ranges of values, so no two touch the same part of a sum (the worker waits
    for them: still one of the fragment's jobs at a time). A move at sealing decodes an
    update's chunks again; one after another it was most of a merge's tail."""
    if len(chunks) < 2:
        for chunk in chunks:
            fn(chunk)
        return
    list(STEP_POOL.map(fn, chunks))


class RoundSums:
    """The open round's sum (`current`) and the jobs that change sums, on the fragment's
    worker. Two sums at most live at once: the round being merged and the next one."""

    def __init__(
        self, fragment: int, size: int, segments: Sequence[int], rule: MergeRule, config: JobConfig
    ) -> None:
        self.size, self.segments, self.rule, self.config = size, tuple(segments), rule, config
        self.current = rule.new(size, self.segments)
        # One thread per fragment: chunk sums and the merge never race on its arrays.
        self.worker = FragmentWorker(f"atoll-frag{fragment}")

    async def ahead(self, fn: Any, *args: Any) -> Any:
        """A job on the worker ahead of the chunk sums queued there (a merge's phases, a
        take-out), behind those of its kind queued before it."""
        return await asyncio.wrap_future(self.worker.urgent(fn, *args))

    def seal(self) -> RoundSum:
        """The open round's sum, closed: a new one is open from now on."""
        sealed, self.current = self.current, self.rule.new(self.size, self.segments)
        return sealed

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)

    # --- weights ------------------------------------------------------------------------
    def summed_weight(self, update: Update) -> float:
        """What an update's values are multiplied by in its round's sum: its weight, times
        its clip where the merge rule clips values."""
        return update.weight * (update.clip if self.rule.clips_values else 1.0)

    @staticmethod
    def counted_norms(update: Update) -> list[float]:
        """The per-tensor norms an update is counted with (radial merging), clipped."""
        return [n * update.clip for n in update.norms]

    def counted(self, update: Update) -> None:
        """A whole update joins its round's totals; nothing of it moves again. One dropped
        for its direction (clip 0) joins at no weight: the round is the others' mean."""
        self.worker.submit(update.chunks.clear)
        update.accumulator.counted(self.counted_weight(update), self.counted_norms(update), 1)

    @staticmethod
    def counted_weight(update: Update) -> float:
        """The weight a whole update joins its round's totals with: none where it was
        dropped (clip 0)."""
        return update.weight if update.clip > 0.0 else 0.0

    def agreement(
        self, update: Update, direction: np.ndarray | None, theta: np.ndarray | None
    ) -> tuple[float | None, float | None]:
        """How a whole update's values agree in sign with `direction` (the fragment's last
        merged outer gradient, True where positive) and with `theta` (the fragment's values:
        an outer gradient along them moves the fragment toward zero), each the L1 mass of
        the values whose sign matches, less that of those whose sign does not, over the
        whole L1 mass: from -1 (every value against) to 1; None for a reference not given,
        0.0 for an update of zeros. Measured in one pass over windows of AGREEMENT_WINDOW
        values drawn at random over the update now that every chunk is in (AGREEMENT_SAMPLE
        values in all, where it has that many), so a sender cannot know which of its values
        are read."""
        windows = [
            (chunk, start)
            for chunk in update.chunks
            for start in range(0, chunk.segment.count, AGREEMENT_WINDOW)
        ]
        wanted = -(-AGREEMENT_SAMPLE // AGREEMENT_WINDOW)
        if len(windows) > wanted:
            windows = _RANDOM.sample(windows, wanted)
        along = toward = total = 0.0
        decoded: dict[int, np.ndarray] = {}  # chunks decoded whole (no window decoder)
        for chunk, start in windows:
            segment = chunk.segment
            stop = min(segment.count, start + AGREEMENT_WINDOW)
            values = _window(update, segment, start, stop, decoded)
            span = slice(segment.offset + start, segment.offset + stop)
            if direction is not None:
                # A value agrees where it is positive along a positive direction, or
                # negative along a negative one.
                along += float(np.where(direction[span], values, -values).sum(dtype=np.float64))
            if theta is not None:  # a value of zero in the fragment counts on neither side
                toward += float((np.sign(theta[span]) * values).sum(dtype=np.float64))
            total += float(np.abs(values).sum(dtype=np.float64))
        scale = 1.0 / total if total > 0.0 else 0.0
        return (
            None if direction is None else along * scale,
            None if theta is None else toward * scale,
        )

    def clip(self, update: Update, factor: float) -> None:
        """Scale a whole update's values (or, for radial merging, the norms it counts with)
        by `factor` < 1, on the worker: its summed chunks give back (1 - factor) of their
        weight; its later moves and take-outs go at the clipped weight."""
        if self.rule.clips_values:
            cut = update.weight * (1.0 - factor)

            def out(chunk: Chunk) -> None:
                if chunk.accumulator is not None:
                    self._sum(update, chunk.accumulator, chunk.segment, -cut)

            each_chunk(out, update.chunks)
        update.clip = factor

    # --- adding -------------------------------------------------------------------------
    def add(
        self, update: Update, offset: int, count: int, data: codecs.Payload
    ) -> asyncio.Future[None]:
        """Queue one chunk to be hashed, decoded and summed into the update's round on the
        fragment's worker, in arrival order; the future raises CodecError or NormTooLarge."""
        return asyncio.wrap_future(
            self.worker.together(self._add_many, update, offset, count, data)
        )

    def add_now(self, update: Update, offset: int, count: int, data: codecs.Payload) -> None:
        """One chunk as `add` sums it, on the calling thread: CodecError or NormTooLarge."""
        (outcome,) = self._add_many([(update, offset, count, data)])
        if outcome is not None:
            raise outcome

    def _add_many(
        self, jobs: Sequence[tuple[Update, int, int, codecs.Payload]]
    ) -> list[BaseException | None]:
        """Chunks queued one after another (`add`), in one go: each hashed in arrival order,
        then summed, those of one range into one sum several at once (RoundSum.add_many).
        Bit for bit the sums chunk after chunk make: the ranges are taken in ascending order,
        only where each update's chunks came so (one call's do; the parts of an update in
        parts may not) and the ranges of one sum are the same or apart; else chunk after
        chunk. A chunk's outcome: None, or why it was refused."""
        outcomes: list[BaseException | None] = [None] * len(jobs)
        live: list[tuple[int, Update, codecs.Segment, RoundSum]] = []
        for i, (update, offset, count, data) in enumerate(jobs):
            if update.abandoned:  # taken out already, or about to be: nothing more of it
                continue
            update.hasher.update(data)
            # A provisional update is summed apart, at the weight it claims, until its
            # weight is known (`sum_provisional`).
            live.append((i, update, codecs.Segment(offset, count, data), self._sum_for(update)))
        ranges: dict[Range, list[int]] = {}
        for k, (_, update, segment, target) in enumerate(live):
            key = (id(target), segment.offset, segment.count, update.codec.name, update.block_size)
            ranges.setdefault(key, []).append(k)
        if not (_ascending(live) and _apart(list(ranges))):
            for i, update, segment, target in live:
                outcomes[i] = self._summed_alone(update, segment, target)
            return outcomes
        for key in sorted(ranges, key=lambda key: key[1]):
            target = live[ranges[key][0]][3]
            ready: list[tuple[int, Update, codecs.Segment, codecs.Ready]] = []
            for k in ranges[key]:
                i, update, segment, _ = live[k]
                budget = update.norm_bound * update.norm_bound - update.squares
                try:
                    one = target.ready_encoded(
                        segment,
                        update.codec,
                        update.block_size,
                        update.weight,
                        MAX_WEIGHTED_VALUE,
                        budget,
                    )
                except codecs.CodecError as err:
                    outcomes[i] = err
                    continue
                if one is None:  # alone, in its place
                    self._summed_together(ready, target, outcomes)
                    outcomes[i] = self._summed_alone(update, segment, target)
                else:
                    ready.append((i, update, segment, one))
            self._summed_together(ready, target, outcomes)
        return outcomes

    def _summed_alone(
        self, update: Update, segment: codecs.Segment, target: RoundSum
    ) -> BaseException | None:
        """`_summed`, its refusal returned, not raised."""
        try:
            self._summed(update, segment, target)
        except Exception as err:
            return err
        return None

    def _summed_together(
        self,
        ready: list[tuple[int, Update, codecs.Segment, codecs.Ready]],
        target: RoundSum,
        outcomes: list[BaseException | None],
    ) -> None:
        """Sum chunks of one range, each checked for it (`ready_encoded`), into `target`;
        `ready` is empty after."""
        if not ready:
            return
        _, first, segment, _ = ready[0]
        squares = target.add_many(
            segment.offset, segment.count, first.codec, first.block_size, [r for *_, r in ready]
        )
        for (i, update, segment, _), sq in zip(ready, squares, strict=True):
            bound = update.norm_bound
            if not math.isfinite(sq) or update.squares + sq > bound * bound:
                # The budget's last rounding (the scales allowed it): taken out after the
                # chunks summed with it, not before them; no float32 bits of theirs differ
                # but those of values this one's rounding touched.
                self._sum(update, target, segment, -update.weight)
                outcomes[i] = self._refusal(update, sq)
                continue
            update.squares += sq
            update.chunks.append(Chunk(segment, target))
        ready.clear()

    def _summed(self, update: Update, segment: codecs.Segment, target: RoundSum) -> None:
        """Sum one hashed chunk of `update` into `target`, unless its norm is over the bound."""
        bound = update.norm_bound
        try:
            # Refused before any of it is added: values far over the bound, added and taken
            # out again, would cancel the other updates' bits in the sum.
            squares = self._sum(
                update, target, segment, update.weight, bound * bound - update.squares
            )
        except codecs.OverSquares as err:
            raise self._refusal(update, err.squares) from None
        if not math.isfinite(squares) or update.squares + squares > bound * bound:
            self._sum(update, target, segment, -update.weight)  # the budget's last rounding
            raise self._refusal(update, squares)
        update.squares += squares
        update.chunks.append(Chunk(segment, target))

    def _refusal(self, update: Update, squares: float) -> Exception:
        """Why a chunk of `squares` (its sum of squares) is refused."""
        if not math.isfinite(squares):
            return codecs.CodecError("payload decodes to NaN or Inf values (a scale overflows)")
        bound = update.norm_bound
        return NormTooLarge(
            f"the update's L2 norm is over {bound:.3g} "
            f"({self.config.max_update_norm_ratio:g} x the fragment's recent updates)",
            math.sqrt(update.squares + squares),
        )

    def _sum_for(self, update: Update) -> RoundSum:
        """Where an update's chunks are summed: its round's sum, or for a provisional update
        the round's sum of provisional updates (made when first needed)."""
        if not update.provisional:
            return update.accumulator
        if update.accumulator.provisional is None:
            update.accumulator.provisional = self.rule.new(self.size, self.segments)
        return update.accumulator.provisional

    def _sum(
        self,
        update: Update,
        target: RoundSum,
        segment: codecs.Segment,
        w: float,
        max_squares: float = math.inf,
    ) -> float:
        """Decode a chunk and add it into `target` weighing `w` (negative: out again), unless
        its sum of squares passes `max_squares` (OverSquares, nothing added)."""
        if w < 0:
            target.took_out(-w)
        return target.add_encoded(
            segment,
            update.codec,
            update.block_size,
            w,
            update.norms,
            MAX_WEIGHTED_VALUE,
            max_squares,
        )

    # --- taking out, and between rounds -------------------------------------------------
    def take_out(self, update: Update) -> None:
        """Every summed chunk of an update out of its sums again."""
        weight = self.summed_weight(update)

        def out(chunk: Chunk) -> None:
            if chunk.accumulator is not None:
                self._sum(update, chunk.accumulator, chunk.segment, -weight)

        each_chunk(out, update.chunks)
        update.chunks.clear()

    def sum_provisional(self, members: list[Update], sealed: RoundSum) -> None:
        """Cap the provisional weights of a sealed round's members against the round's other
        members, and sum those members in: their sum made as they arrived if every weight
        stands and nothing was taken out of it, else again from their chunks at the final
        weights (a claimed weight never enters the round's own sum, where it could drown the
        others' in float32)."""
        share = self.config.max_weight_share
        weights = capped_weights(
            [u.weight for u in members], [u.provisional for u in members], share
        )
        tightened = self.clip_against_round(members)
        summed = [u for u in members if u.provisional]
        held, sealed.provisional = sealed.provisional, None
        if (
            held is not None
            and not tightened
            and summed
            and held.taken_out <= share * min(u.weight for u in summed)
            and all(w == u.weight for u, w in zip(members, weights, strict=True) if u.provisional)
        ):
            # As claimed (always so for a round of one), and nothing taken out of their sum
            # since that weighed more than a capped member may (a claimed weight is
            # unbounded: taking a far heavier one out may have cancelled the others' bits;
            # one within the cap leaves them a few float32 roundings, as summing does): that
            # sum, made as they arrived, is the round's if it has no other member, else
            # added to it range by range on the step pool.
            if sealed.weight == 0:
                sealed.total = held.total
            else:
                step = max(1, -(-self.size // (4 * STEP_THREADS)))

                def add(start: int) -> None:
                    part = sealed.total[start : start + step]
                    np.add(part, held.total[start : start + step], out=part)

                list(STEP_POOL.map(add, range(0, self.size, step)))
            for update in summed:
                sealed.counted(self.counted_weight(update), self.counted_norms(update), 1)
                update.chunks.clear()
            return
        for update, weight in zip(members, weights, strict=True):
            if update.provisional:
                update.weight = weight
        # Chunks of one range of values are summed in turn, ranges side by side on the
        # step pool's threads (while this worker waits for them: still one job at a time).
        by_range: dict[tuple[int, int], list[tuple[Update, codecs.Segment]]] = {}
        for update in summed:
            for chunk in update.chunks:
                key = (chunk.segment.offset, chunk.segment.count)
                by_range.setdefault(key, []).append((update, chunk.segment))
        ranges = sorted(by_range)
        apart = all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(ranges))
        jobs = list(by_range.values()) if apart else [[c for r in ranges for c in by_range[r]]]

        def run(job: list[tuple[Update, codecs.Segment]]) -> None:
            for update, segment in job:
                self._sum(update, sealed, segment, self.summed_weight(update))

        list(STEP_POOL.map(run, jobs))
        for update in summed:
            sealed.counted(self.counted_weight(update), self.counted_norms(update), 1)
            update.chunks.clear()

    def clip_against_round(self, members: list[Update]) -> bool:
        """A provisional member began with no other slot's update to measure it against, so
        it was clipped at most to the warm-up bound (`Guards.clip_bound`): a hostile slot
        first in a fragment's first round merged at that bound, many times an honest update.
        Now its round's other members are known: it is clipped to --clip-norm-ratio times the
        median of their norms as they merge (each scaled to its inner steps), where that is
        tighter, and merged at no weight (its clip 0, as `Guards.drop_bound`) where it is
        over --max-update-norm-ratio times that median: it carries no honest progress worth
        keeping. Whether any clip changed (their sum made as they arrived no longer holds)."""
        norms = Recent()  # the round's members' norms as they merge, as the history keeps them
        for u in members:
            if u.clip > 0.0:
                norms.set(u.learner, u.norm * u.clip, u.c_steps)
        changed = False
        for update in members:
            if not update.provisional or update.clip == 0.0 or update.norm == 0.0:
                continue
            median = others_norm(norms, update.learner, update.c_steps)
            if median is None:
                continue
            if update.norm * update.clip > self.config.max_update_norm_ratio * median:
                update.clip = 0.0  # as `Guards.drop_bound`: counted at no weight
                norms.discard(update.learner)
                changed = True
                continue
            bound = self.config.clip_norm_ratio * median  # as `Guards.clip_bound`
            if 0.0 < bound < update.norm * update.clip:
                update.clip = bound / update.norm
                norms.set(update.learner, bound, update.c_steps)  # the next member sees it so
                changed = True
        return changed

    def move(self, update: Update, sealed: RoundSum, cap: float | None = None) -> None:
        """Chunks summed into a round being merged (or its provisional sum) go to the
        update's round now. A provisional update with a `cap` (other learners' weights are
        known by now) is capped as an update that begins is and joins that round's own sum:
        its round then needs no provisional sum of its own (a fragment-sized array)."""
        old = self.summed_weight(update)
        if update.provisional and cap is not None:
            update.weight = update_weight(update.c_tokens, update.c_steps, cap, update.staleness)
            update.provisional = False
        new = self.summed_weight(update)
        # Every summed chunk not in the update's sum now: those of the sealed round, and
        # one whose sum began as the round was sealed (it read the new round, and was summed
        # into its provisional sum at the weight before this settled it). A provisional sum
        # made here and left empty costs no memory until written.
        target = self._sum_for(update)
        moving = [
            chunk
            for chunk in update.chunks
            if chunk.accumulator is not None and chunk.accumulator is not target
        ]

        def move(chunk: Chunk) -> None:
            source = chunk.accumulator
            assert source is not None  # `moving` holds summed chunks only
            if new == old:
                source.took_out(old)
                source.move_encoded(
                    target,
                    chunk.segment,
                    update.codec,
                    update.block_size,
                    old,
                    update.norms,
                    MAX_WEIGHTED_VALUE,
                )
            else:  # out at the weight it was summed at, in at the one settled
                self._sum(update, source, chunk.segment, -old)
                self._sum(update, target, chunk.segment, new)
            chunk.accumulator = target

        each_chunk(move, moving)


def _window(
    update: Update,
    segment: codecs.Segment,
    start: int,
    stop: int,
    decoded: dict[int, np.ndarray],
) -> np.ndarray:
    """Values [start, stop) of a segment of `update`: decoded alone where its codec can
    (blockwise, the window on whole blocks), else from the segment decoded whole once."""
    blockwise, block_size = update.codec.blockwise, update.block_size
    if blockwise is not None and block_size > 0 and blockwise.starts_block(start, block_size):
        return blockwise.decode_range(segment.data, segment.count, block_size, start, stop)
    key = id(segment)
    if key not in decoded:
        decoded[key] = update.codec.decode(segment.data, segment.count, block_size)
    return decoded[key][start:stop]
