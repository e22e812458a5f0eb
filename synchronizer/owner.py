"""A fragment's owner: sums updates into the open round as their chunks arrive, merges, takes
the outer step and commits.

One replica owns a fragment at a time (a lease with a fencing epoch, `ownership.py`). The
owner holds the fragment's value, optimizer state and downlink residual in memory, and two
accumulators at most (the round being merged, and the next one that updates arriving during
the merge go to), whatever the number of learners. A chunk is decoded and summed on the
fragment's own worker thread (compiled kernels release the GIL) while the next one arrives;
chunks of one range queued there together are summed in one pass that reads and writes the
sum once for all of them (`_add_many`), leaving the bits those chunks one after another
leave. An update is recorded in Redis only once all its chunks are summed and checked; one
refused after summing is taken out again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import xxhash

from services import codec as codecs
from services import telemetry as tm
from services.config import JobConfig
from services.downlink import fused_step, step_segment
from services.tape import Tape
from synchronizer.core.merge import (
    MERGE_RULES,
    Accumulator,
    OuterOptimizer,
    capped_weights,
    live_round_scale,
    staleness_weight,
    token_weight,
)
from synchronizer.core.open_round import OpenRound
from synchronizer.core.recent import Recent
from synchronizer.core.rounds import RoundPolicy, RoundState, decide
from synchronizer.store.redis_store import Commit, ControlStore, Live, Pointer
from synchronizer.store.tensors import TensorStore, object_name, version_of
from synchronizer.values import VALUE_EVERY, keyframe_version, value_at
from synchronizer.worker import FragmentWorker

log = structlog.get_logger("atoll.synchronizer.owner")
# Kept in the tensor store after a commit: the keyframe the pointer names and the one before
# (a fetch may still be reading it), every delta after the older of them, and at least the
# last KEEP_DELTAS deltas (what catches a learner up). A merge writes its delta before the
# pointer moves; a keyframe (value, optimizer state, residual) every VALUE_EVERY-th version,
# in the background (values.py).
KEEP_DELTAS = 10
EVALUATE_EVERY_S = 0.1
T_SYNC_DECAY = 0.8
# Outer steps of every owned fragment share one pool, a thread per core.
_STEP_POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="atoll-step")
MAX_WEIGHTED_VALUE = 1e37  # weight x value beyond this would overflow the float32 sum
# An update covering more steps than its reference may be this many times its norm at most
# (a claimed step count cannot widen the bound without limit).
MAX_STEP_SPAN = 8.0
# With no other learner's update to measure an update against, a fragment of all zeros (or
# nearly: biases) is measured as if its values had this root mean square.
REFERENCE_RMS = 0.1


class RoundBusy(ValueError):
    """The learner already has an update in the open round; it may resend later."""


class NormTooLarge(ValueError):
    """An update's norm is out of bounds against the fragment's recent updates; `norm`: the
    norm its values reached before they were refused (None: not measured)."""

    def __init__(self, message: str, norm: float | None = None) -> None:
        super().__init__(message)
        self.norm = norm


def _apart(ranges: list[tuple[int, int, int, str, int]]) -> bool:
    """Whether ranges (sum, offset, count, codec, block size) of one sum, each different,
    share no value: summing them in any order gives the same bits."""
    ends: dict[int, int] = {}
    for target, offset, count, _, _ in sorted(ranges, key=lambda r: (r[0], r[1])):
        if offset < ends.get(target, 0):
            return False
        ends[target] = offset + count
    return True


def _ascending(chunks: list[tuple[int, Update, codecs.Segment, Accumulator]]) -> bool:
    """Whether each update's chunks came in ascending order of their values."""
    last: dict[int, int] = {}
    for _, update, segment, _ in chunks:
        if segment.offset < last.get(id(update), -1):
            return False
        last[id(update)] = segment.offset
    return True


class OwnerLost(RuntimeError):
    """This replica no longer owns the fragment (its lease lapsed or was taken)."""


@dataclass(eq=False)
class Chunk:
    """A chunk summed into a round's accumulator (None: not summed yet, its update's weight
    is provisional), kept until its update is received (provisional: until its round merges)."""

    segment: codecs.Segment
    accumulator: Accumulator | None


@dataclass(eq=False)
class Update:
    """An update on its way in: what it weighs, where it is summed, its chunks so far."""

    learner: str
    incarnation: str
    seq: int
    base_version: int
    c_steps: int
    c_tokens: int
    compute_seconds: float
    weight: float
    norms: tuple[float, ...]
    codec: codecs.Codec
    block_size: int
    accumulator: Accumulator
    chunks: list[Chunk] = field(default_factory=list)
    hasher: Any = field(default_factory=xxhash.xxh3_64)
    norm_bound: float = math.inf
    squares: float = 0.0  # sum of squares of the decoded values so far
    # No other learner's update to cap the weight against when it began: it is summed only
    # once its round is sealed, capped against the round's other members then.
    provisional: bool = False
    arrived: int = 0  # values whose chunks have come (queued to be summed, or summed)
    # When its first chunk came, and that chunk's values: its pace is from the chunks after.
    first_at: float = 0.0
    first_values: int = 0
    abandoned: bool = False  # will not be received: chunk sums still queued add nothing
    staleness: float = 1.0  # what its weight was multiplied by for being behind (`begin`)
    # What its norm was scaled by to merge within its fragment's clip bound (`clip_bound`):
    # 1 unclipped. Set once whole, before it is recorded.
    clip: float = 1.0
    # Its move to the next round when its round was sealed while it arrived: the move may
    # settle a provisional weight, so whoever reads the weight on the event loop waits.
    moved: Future[None] | None = None

    @property
    def norm(self) -> float:
        return math.sqrt(self.squares)

    @property
    def uid(self) -> str:
        return f"{self.learner}/{self.incarnation}/{self.seq}"


@dataclass(frozen=True)
class Keyframe:
    """A version's value, optimizer state and residual, written whole (values.py)."""

    version: int
    value: str
    state: tuple[str, ...]


class FragmentOwner:
    def __init__(
        self,
        *,
        fragment: int,
        size: int,
        segments: Sequence[int],
        epoch: int,
        replica: str,
        config: JobConfig,
        store: ControlStore,
        tensors: TensorStore,
        tape: Tape,
        fragments: int,
    ) -> None:
        self.fragment, self.size, self.segments = fragment, size, tuple(segments)
        self.epoch, self.replica = epoch, replica
        self.config, self.store, self.tensors, self.tape = config, store, tensors, tape
        self.fragments = fragments
        self.rule = MERGE_RULES[config.merge]
        self.optimizer = OuterOptimizer(config.outer_lr, config.outer_momentum)
        self.downlink = codecs.by_name(config.downlink_codec)
        self.policy = RoundPolicy(
            mode=config.mode,
            quorum=config.quorum,
            overlap_steps=config.overlap_steps,
            gamma=config.grace_gamma,
            fixed_grace_s=config.grace_seconds,
            max_grace_s=config.max_grace_seconds,
        )
        self.version: int | None = None  # None: no value yet (the job is not initialized)
        self.theta = np.zeros(0, np.float32)
        self.state: list[np.ndarray] = []
        self.residual = np.zeros(0, np.float32)
        # Keyframes the pointer has named, newest last (two kept), and one written since that
        # the next commit names; the write in progress, which the next outer step waits for
        # (it changes the arrays being written).
        self.keyframes: list[Keyframe] = []
        self.written: Keyframe | None = None
        self._writing: asyncio.Task[None] | None = None
        self.theta_norm = 0.0
        # Each learner's last accepted update's weight (as capped) on this fragment, and its
        # L2 norm under the inner steps it covered (`norm_bound`).
        self.weights = Recent()
        self.norms = Recent()
        # Whose idempotency records of this fragment each slot's are, as last recorded here.
        self.holders: dict[str, str] = {}
        self.current = self.rule.new(size, self.segments)
        self.open: OpenRound[Update] = OpenRound()  # received, and streaming in
        self.opened_at = time.monotonic()
        self.quorum_at: float | None = None
        self.deadline: float | None = None
        self.t_sync_s = 0.0
        self.last_received = 0.0  # when the open round's newest member was received
        self.held_at = 0.0  # when the open round was last held for an update streaming in
        self.lost = False
        self.merging = False
        self.wake = asyncio.Event()
        self._gc: asyncio.Task[None] | None = None
        # One thread per fragment: chunk sums and the merge never race on its arrays.
        self.worker = FragmentWorker(f"atoll-frag{fragment}")

    async def _ahead_on_worker(self, fn: Any, *args: Any) -> Any:
        """A job on the worker ahead of the chunk sums queued there (a merge's phases, a
        take-out), behind those of its kind queued before it."""
        return await asyncio.wrap_future(self.worker.urgent(fn, *args))

    # --- loading ------------------------------------------------------------------------
    async def load(self, pointer: Pointer | None) -> None:
        """Take the committed value (its keyframe plus the deltas since) and the keyframe's
        optimizer state and residual from the tensor store (nothing if none yet)."""
        if pointer is None:
            return
        _, self.theta = await value_at(
            self.store,
            self.tensors,
            self.fragment,
            self.downlink,
            self.config.block_size,
            pointer=pointer,
        )
        if self.theta.size != self.size:
            raise ValueError(
                f"fragment {self.fragment}'s stored value has {self.theta.size} values, not "
                f"{self.size}: the tensor store holds another job's objects"
            )
        states = [(await self.tensors.get_arrays(n, self.size))[0] for n in pointer.state]
        # float64 norm of a large fragment: off the event loop, which renews the leases.
        self.theta_norm = await asyncio.to_thread(_norm, self.theta)
        n_opt = len(self.optimizer.init(self.theta[:0]))
        self.state = states[:n_opt] or self.optimizer.init(self.theta)
        self.residual = states[n_opt] if len(states) > n_opt else np.zeros_like(self.theta)
        self.keyframes = [Keyframe(keyframe_version(pointer), pointer.value, pointer.state)]
        # The norm history the fragment's updates are bounded by, as its last owner left it.
        for learner, (norm, steps) in (await self.store.norms(self.fragment)).items():
            self.norms.set(learner, norm, steps)
        self.version = pointer.version
        self.opened_at = time.monotonic()
        log.info("fragment_loaded", fragment=self.fragment, version=self.version, epoch=self.epoch)

    async def initial_state(self, values: np.ndarray) -> tuple[str, tuple[str, ...]]:
        """Write a fragment's initial value and optimizer state; return their names."""
        arrays = [*self.optimizer.init(values), np.zeros_like(values, np.float32)]
        frame = self._keyframe_names(0, len(arrays))
        await self._write_keyframe(frame, values, arrays)
        return frame.value, frame.state

    def _keyframe_names(self, version: int, states: int) -> Keyframe:
        job, p, e = self.store.job, self.fragment, self.epoch
        return Keyframe(
            version,
            object_name(job, p, version, e, "value"),
            tuple(object_name(job, p, version, e, f"state{i}") for i in range(states)),
        )

    async def _write_keyframe(
        self, frame: Keyframe, value: np.ndarray, states: Sequence[np.ndarray]
    ) -> None:
        await asyncio.gather(
            self.tensors.put(frame.value, value),
            *(self.tensors.put(n, a) for n, a in zip(frame.state, states, strict=True)),
        )

    def _start_keyframe(self, version: int) -> None:
        """Write this version's value, state and residual in the background; the next
        commit names them once written."""
        arrays = [*self.state, self.residual]
        frame = self._keyframe_names(version, len(arrays))

        async def write() -> None:
            started = time.monotonic()
            try:
                await self._write_keyframe(frame, self.theta, arrays)
            except Exception as err:  # the pointer keeps the older keyframe; deltas cover it
                log.warning(
                    "keyframe_failed", fragment=self.fragment, version=version, error=repr(err)
                )
                # What was written is collected later if the store refuses now: a merge
                # waits for this task, and must not fail with it.
                with contextlib.suppress(Exception):
                    await self.tensors.delete([frame.value, *frame.state])
                return
            self.written = frame
            log.info(
                "keyframe_written",
                fragment=self.fragment,
                version=version,
                seconds=round(time.monotonic() - started, 4),
            )

        self._writing = asyncio.create_task(write())

    async def _keyframe_written(self) -> None:
        """Wait for a keyframe write in progress: it reads the arrays the step changes."""
        if self._writing is not None:
            await asyncio.shield(self._writing)
            self._writing = None

    # --- ingest -------------------------------------------------------------------------
    def begin(
        self,
        *,
        learner: str,
        incarnation: str,
        seq: int,
        base_version: int,
        c_steps: int,
        c_tokens: int,
        compute_seconds: float,
        norms: Sequence[float],
        codec: codecs.Codec,
        block_size: int,
    ) -> Update:
        if any(
            u.learner == learner and (u.incarnation, u.seq) != (incarnation, seq)
            for u in self.open.of(learner)
        ):
            # One update per learner in a round (a learner sends a fragment again only once
            # its last one merged): more would let one slot fill the round and its history.
            raise RoundBusy(
                f"learner {learner!r} already has an update in fragment {self.fragment}'s open "
                "round; resend once it merges"
            )
        cap, asked = self.weight_cap(learner), token_weight(c_tokens, c_steps)
        if cap is not None and asked > cap:
            log.info("weight_capped", fragment=self.fragment, learner=learner, weight=asked)
        # With no cap (the fragment's first updates, or the first since this owner took it
        # over) its weight is provisional: capped against the other members of its round
        # once the round is sealed (`_sum_provisional`), or against other learners' weights
        # if it is still arriving then (`_move`); summed apart until then.
        staleness = 1.0
        if self.version is not None and self.config.staleness_decay != 1.0:
            staleness = staleness_weight(self.version - base_version, self.config.staleness_decay)
        bound = self.norm_bound(learner, c_steps)
        claimed = math.sqrt(sum(float(n) ** 2 for n in norms))
        if claimed > bound:
            raise NormTooLarge(
                f"the update's tensor norms total {claimed:.3g}, over the bound {bound:.3g} "
                f"({self.config.max_update_norm_ratio:g} x the fragment's recent updates)"
            )
        update = Update(
            learner,
            incarnation,
            seq,
            base_version,
            c_steps,
            c_tokens,
            compute_seconds,
            update_weight(c_tokens, c_steps, cap, staleness),
            tuple(norms),
            codec,
            block_size,
            self.current,
            norm_bound=bound,
            provisional=cap is None,
            staleness=staleness,
        )
        self.open.stream(update)
        return update

    def _summed_weight(self, update: Update) -> float:
        """What an update's values are multiplied by in its round's sum: its weight, times
        its clip where the merge rule clips values."""
        return update.weight * (update.clip if self.rule.accumulator.clips_values else 1.0)

    @staticmethod
    def _counted_norms(update: Update) -> list[float]:
        """The per-tensor norms an update is counted with (radial merging), clipped."""
        return [n * update.clip for n in update.norms]

    def weight_cap(self, learner: str) -> float | None:
        """The most an update of `learner` may weigh: --max-weight-share times the median
        weight of the other learners' last updates (its fair share), so that whatever tokens
        it claims it cannot buy the merge, and its own claims never move the bar. None while
        no other learner's update is known."""
        median = self.weights.median_of_others(learner)
        return None if median is None else self.config.max_weight_share * median

    def norm_bound(self, learner: str, steps: int) -> float:
        """The largest L2 norm an update of `steps` inner steps may have:
        --max-update-norm-ratio times the median of the other learners' last accepted
        updates (a learner's own never moves its bar; a refused one moves no one's, so
        refusals cost an attacker nothing and gain it nothing), each scaled to `steps`
        (`step_scale`: a learner whose reply came late sends more steps at once, and the next
        update fewer); never below the fragment's own norm, as if its values had an RMS of at
        least REFERENCE_RMS (a fragment of zeros): learners whose updates outgrow each other's
        tiny last ones together, as in warm-up, are not shut out, and an attacker gains at
        most the fragment's size times its capped weight. With no other learner's update
        yet, --max-update-norm-ratio times that size (an outer gradient is a fraction of the
        parameters it moves); never the learner's own last norm, which would let a slot
        alone on a fragment raise its own bar tenfold with every update."""
        ratio = self.config.max_update_norm_ratio
        size = max(self.theta_norm, REFERENCE_RMS * math.sqrt(self.size))
        median = self.norms.median_of_others(learner, lambda s: step_scale(steps, s))
        if median is not None:
            return max(ratio * median, size)
        return ratio * size

    def clip_bound(self, learner: str, steps: int) -> float:
        """The L2 norm an update of `steps` inner steps is scaled down to if larger:
        --clip-norm-ratio times the median of the other slots' last accepted updates of the
        fragment, as they merged (clipped), each scaled to `steps` (`step_scale`). Kept in
        Redis (`store.norms`), so a new owner measures against the same history. A slot's
        own history never moves its bar, and only clipped norms enter the history, so slots
        short of a majority of those with history cannot raise it: their entries sit above
        the median. With no other slot's (the fragment's first update, or a slot alone on
        it): --warmup-update-rms per value, never a multiple of the fragment's own norm,
        which let one update replace the fragment."""
        median = self.norms.median_of_others(learner, lambda s: step_scale(steps, s))
        if median:  # None, or others that sent nothing: the warm-up bound
            return self.config.clip_norm_ratio * median
        return self.config.warmup_update_rms * math.sqrt(self.size)

    def _clip(self, update: Update, factor: float) -> None:
        """Scale a whole update's values (or, for radial merging, the norms it counts with)
        by `factor` < 1, on the worker: its summed chunks give back (1 - factor) of their
        weight; its later moves and take-outs go at the clipped weight."""
        if self.rule.accumulator.clips_values:
            cut = update.weight * (1.0 - factor)

            def out(chunk: Chunk) -> None:
                if chunk.accumulator is not None:
                    self._sum(update, chunk.accumulator, chunk.segment, -cut)

            _each_chunk(out, update.chunks)
        update.clip = factor

    def check_norms(self, update: Update) -> None:
        """The per-tensor norms an update claimed (radial merging divides by them) must be
        the norms of what it sent."""
        if not self.rule.needs_norms:
            return
        claimed = math.sqrt(sum(float(n) ** 2 for n in update.norms))
        if abs(claimed - update.norm) > 1e-3 * max(claimed, update.norm) + 1e-30 or any(
            n <= 0.0 for n in update.norms
        ):
            raise NormTooLarge(
                f"the update's tensor_norms (total {claimed:.6g}) are not the norms of its "
                f"values ({update.norm:.6g}); send the norms of the decoded outer gradient"
            )

    def add(
        self, update: Update, offset: int, count: int, data: codecs.Payload
    ) -> asyncio.Future[None]:
        """Queue one chunk to be hashed, decoded and summed into the update's round on the
        fragment's worker, in arrival order; the future raises CodecError or NormTooLarge."""
        if not update.arrived:
            update.first_at, update.first_values = time.monotonic(), count
        update.arrived += count
        return asyncio.wrap_future(
            self.worker.together(self._add_many, update, offset, count, data)
        )

    # The chunk records and the sums are touched on the worker thread only, one job at a
    # time; which round an update belongs to (`update.accumulator`, the members) changes on
    # the event loop only. A chunk is summed into the round its update belongs to when the
    # job runs, and its record says which that was.
    def _add(self, update: Update, offset: int, count: int, data: codecs.Payload) -> None:
        """One chunk as `add` sums it, on the calling thread: CodecError or NormTooLarge."""
        (outcome,) = self._add_many([(update, offset, count, data)])
        if outcome is not None:
            raise outcome

    def _add_many(
        self, jobs: Sequence[tuple[Update, int, int, codecs.Payload]]
    ) -> list[BaseException | None]:
        """Chunks queued one after another (`add`), in one go: each hashed in arrival order,
        then summed, those of one range into one sum several at once (Accumulator.add_many).
        Bit for bit the sums chunk after chunk make: the ranges are taken in ascending order,
        only where each update's chunks came so (one call's do; the parts of an update in
        parts may not) and the ranges of one sum are the same or apart; else chunk after
        chunk. A chunk's outcome: None, or why it was refused."""
        outcomes: list[BaseException | None] = [None] * len(jobs)
        live: list[tuple[int, Update, codecs.Segment, Accumulator]] = []
        for i, (update, offset, count, data) in enumerate(jobs):
            if update.abandoned:  # taken out already, or about to be: nothing more of it
                continue
            update.hasher.update(data)
            # A provisional update is summed apart, at the weight it claims, until its
            # weight is known (`_sum_provisional`).
            live.append((i, update, codecs.Segment(offset, count, data), self._sum_for(update)))
        ranges: dict[tuple[int, int, int, str, int], list[int]] = {}
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
        self, update: Update, segment: codecs.Segment, target: Accumulator
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
        target: Accumulator,
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

    def _summed(self, update: Update, segment: codecs.Segment, target: Accumulator) -> None:
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

    def _sum_for(self, update: Update) -> Accumulator:
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
        target: Accumulator,
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

    def _take_out(self, update: Update) -> None:
        weight = self._summed_weight(update)

        def out(chunk: Chunk) -> None:
            if chunk.accumulator is not None:
                self._sum(update, chunk.accumulator, chunk.segment, -weight)

        _each_chunk(out, update.chunks)
        update.chunks.clear()

    def _sum_provisional(self, members: list[Update], sealed: Accumulator) -> None:
        """Cap the provisional weights of a sealed round's members against the round's other
        members, and sum those members in: their sum made as they arrived if every weight
        stands and nothing was taken out of it, else again from their chunks at the final
        weights (a claimed weight never enters the round's own sum, where it could drown the
        others' in float32)."""
        weights = capped_weights(
            [u.weight for u in members],
            [u.provisional for u in members],
            self.config.max_weight_share,
        )
        summed = [u for u in members if u.provisional]
        held, sealed.provisional = sealed.provisional, None
        if (
            held is not None
            and summed
            and held.taken_out <= self.config.max_weight_share * min(u.weight for u in summed)
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
                step = max(1, -(-self.size // (4 * (os.cpu_count() or 1))))

                def add(start: int) -> None:
                    part = sealed.total[start : start + step]
                    np.add(part, held.total[start : start + step], out=part)

                list(_STEP_POOL.map(add, range(0, self.size, step)))
            for update in summed:
                sealed.counted(update.weight, self._counted_norms(update), 1)
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
                self._sum(update, sealed, segment, self._summed_weight(update))

        list(_STEP_POOL.map(run, jobs))
        for update in summed:
            sealed.counted(update.weight, self._counted_norms(update), 1)
            update.chunks.clear()

    def _move(self, update: Update, sealed: Accumulator, cap: float | None = None) -> None:
        """Chunks summed into a round being merged (or its provisional sum) go to the
        update's round now. A provisional update with a `cap` (other learners' weights are
        known by now) is capped as `begin` caps an update and joins that round's own sum:
        its round then needs no provisional sum of its own (a fragment-sized array)."""
        old = self._summed_weight(update)
        if update.provisional and cap is not None:
            update.weight = update_weight(update.c_tokens, update.c_steps, cap, update.staleness)
            update.provisional = False
        new = self._summed_weight(update)
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

        _each_chunk(move, moving)

    async def abandon(self, update: Update) -> None:
        """An update that will not be received (its stream broke, or it was refused): its
        chunk sums still queued add nothing, and what was summed is taken out ahead of
        queued jobs, so before any round sealed from now on moves its chunks or steps.
        Queued behind them, a merge could step a sum that still held its values."""
        if self.open.drop(update):
            update.abandoned = True
            await self._ahead_on_worker(self._take_out, update)

    async def receive(self, update: Update, checksum: int) -> tuple[str, int]:
        """Record a whole, checked update in Redis; on any status but `received` it is taken
        out of the sum again. Returns (status, version). It runs to its end even when the
        call that sent the update is cancelled (its learner died): Redis may have recorded
        it already, and a round member Redis holds but the sums do not would never merge."""
        return await asyncio.shield(self._receive(update, checksum))

    async def _receive(self, update: Update, checksum: int) -> tuple[str, int]:
        await self._moved(update)  # the weight recorded is the one it is summed at
        bound = self.clip_bound(update.learner, update.c_steps)
        if update.norm > bound:
            # Scaled down, not refused: an honest update outgrowing the others' (warm-up,
            # a late reply covering many steps) still brings its direction.
            await self._ahead_on_worker(self._clip, update, bound / update.norm)
            log.info(
                "update_clipped",
                fragment=self.fragment,
                learner=update.learner,
                norm=update.norm,
                bound=bound,
            )
        record = {
            "learner": update.learner,
            "incarnation": update.incarnation,
            "seq": update.seq,
            "base_version": update.base_version,
            "c_steps": update.c_steps,
            "c_tokens": update.c_tokens,
            "weight": update.weight,
            "clip": update.clip,
            "epoch": self.epoch,
        }
        try:
            status, version = await self._record(update, checksum, record)
        except BaseException:
            await self.abandon(update)
            raise
        if status != "received":
            await self.abandon(update)
            if status == "not_owner":
                self.lost = True
            return status, version
        await self._moved(update)  # its round was sealed meanwhile
        if not update.provisional:  # received: nothing of it moves again
            self.worker.submit(update.chunks.clear)
            update.accumulator.counted(update.weight, self._counted_norms(update), 1)
        self.weights.set(update.learner, update.weight)  # as capped (provisional: as claimed)
        self.norms.set(update.learner, update.norm * update.clip, update.c_steps)
        self.open.receive(update)  # of the open round: one sealed meanwhile moved it
        self.last_received = time.monotonic()
        tm.UPDATES_ACCEPTED.inc()
        self.tape.write(
            "accepted",
            uid=update.uid,
            fragment=self.fragment,
            learner=update.learner,
            epoch=self.epoch,
        )
        self.wake.set()
        return status, version

    @staticmethod
    async def _moved(update: Update) -> None:
        """Once the update's last move to a newer round (which may settle its provisional
        weight) has run on the worker."""
        while update.moved is not None and not update.moved.done():
            await asyncio.wrap_future(update.moved)

    async def _record(
        self, update: Update, checksum: int, record: dict[str, Any]
    ) -> tuple[str, int]:
        """Record the update in Redis (`store/lua/receive.lua`). The slot's idempotency records of
        this fragment are one incarnation's: while they are this update's (as far as this
        owner knows), one call; else only the slot's current incarnation (the last to say
        hello) may take their place, looked up first."""

        async def receive(generation: int | None) -> tuple[str, int]:
            return await self.store.receive(
                self.fragment,
                self.replica,
                self.epoch,
                learner=update.learner,
                incarnation=update.incarnation,
                seq=update.seq,
                checksum=checksum,
                base_version=update.base_version,
                max_staleness=self.config.max_staleness,
                record=record,
                generation=generation,
                norm=(update.norm * update.clip, update.c_steps),
            )

        if self.holders.get(update.learner) == update.incarnation:
            status, version = await receive(None)
            if status != "new_incarnation":
                return status, version
        current = await self.store.incarnation(update.learner)
        if current is not None and current[0] != update.incarnation:
            return "superseded", 0
        status, version = await receive(current[1] if current is not None else 0)
        if status in ("received", "again", "duplicate"):
            self.holders[update.learner] = update.incarnation
        return status, version

    # --- the round ----------------------------------------------------------------------
    def round_state(self, live: Live, now: float) -> tuple[RoundState, float]:
        """The open round as the round rule reads it, and the slowest live step time."""
        contributors, sending = self.open.contributors(), self.open.sending()
        finished = sum(1 for lv in live.learners if lv.finished)
        waiting = sum(
            1
            for lv in live.learners
            if not lv.finished
            and lv.learner not in contributors
            and (lv.still_to_send is None or self.fragment in lv.still_to_send)
        )
        waiting += len(sending - {lv.learner for lv in live.learners})
        # When each update streaming into this round is expected in, at the pace its chunks
        # have come since its first (an update covers the whole fragment); none before its
        # second chunk.
        etas = tuple(
            (self.size - u.arrived) * (now - u.first_at) / (u.arrived - u.first_values)
            for u in self.open.in_flight
            if u.accumulator is self.current and u.arrived > u.first_values
        )
        members = [lv for lv in live.learners if lv.learner in contributors]
        slowest_member = max((lv.step_time_ema_s for lv in members), default=0.0)
        state = RoundState(
            contributors=len(contributors),
            live_learners=len(live.learners),
            opened_at=self.opened_at,
            quorum_at=self.quorum_at,
            deadline=self.deadline,
            now=now,
            finished_learners=finished,
            waiting=waiting,
            streaming_eta_s=etas,
            first_update_at=min((u.first_at for u in self.open.members), default=None),
            patience_s=self.config.inner_steps * slowest_member if slowest_member else None,
        )
        slowest = max((lv.step_time_ema_s for lv in live.learners), default=0.0)
        return state, slowest

    async def evaluate(self, live: Live) -> None:
        """Decide on the open round; merge it when the rule says so."""
        if self.version is None or self.merging or self.lost or not self.open.members:
            return
        now = time.monotonic()
        state, slowest = self.round_state(live, now)
        decision = decide(state, self.policy, slowest_step_s=slowest, t_sync_s=self.t_sync_s)
        if decision.new_deadline is not None and decision.grace_s is not None:
            self.quorum_at, self.deadline = now, decision.new_deadline
            tm.GRACE_SECONDS.observe(decision.grace_s)
        if decision.held:
            self.held_at = now
        if decision.merge_now:
            scaled = self.config.partial_rounds == "scaled"
            await self.merge(frozenset(lv.learner for lv in live.learners) if scaled else None)

    async def merge(self, live_learners: frozenset[str] | None) -> None:
        """Seal the open round and commit it. `live_learners`: the slots with a live session
        now, which scale its step (`live_round_scale`); None: a full step."""
        self.merging = True
        started = time.monotonic()
        # A round is ready once its last update is in, or its grace window ends (the last
        # time it was held for an update streaming in, if later).
        window = max(self.deadline or 0.0, self.held_at)
        ready = max(self.last_received, min(window, started))
        try:
            members, sealed = self._seal()
            if not members:
                return
            try:
                await self._commit(members, sealed, live_learners, ready)
            except (OwnerLost, asyncio.CancelledError):
                raise
            except BaseException as err:
                # The round was sealed and the value may have moved in memory: nothing of it
                # is committed, so this owner gives the fragment up; the next one loads the
                # committed state and the learners resend the round's updates.
                self.lost = True
                tm.MERGE_ABORTS.inc()
                log.error("merge_failed", fragment=self.fragment, error=repr(err))
                raise OwnerLost(f"fragment {self.fragment}: merge failed ({err!r})") from err
        finally:
            self.merging = False

    def _seal(self) -> tuple[list[Update], Accumulator]:
        """Close the round: its members and sum. Updates still arriving belong to the next
        round from now on; their chunks summed so far move there (queued on the worker
        before the merge's own job)."""
        sealed = self.current
        self.current = self.rule.new(self.size, self.segments)
        members = self.open.seal()  # once the next sum is made: a failure leaves the round
        for update in self.open.in_flight:
            if update.accumulator is sealed:
                update.accumulator = self.current
                # Weights are read here, on the event loop; the update changes on the worker.
                cap = self.weight_cap(update.learner) if update.provisional else None
                update.moved = self.worker.urgent(self._move, update, sealed, cap)
        return members, sealed

    def _step(self, sealed: Accumulator, scale: float) -> list[codecs.Segment]:
        """The outer step and the downlink delta, in place, segment by segment; segments
        are independent, so they run on every core (numpy releases the GIL)."""
        sealed.prepare()
        step = codecs.segment_values(
            self.downlink, self.config.block_size, self.config.max_chunk_bytes
        )

        factor = sealed.gradient_factor(scale)

        def one(start: int) -> codecs.Segment:
            s = slice(start, min(self.size, start + step))
            if factor is not None:
                data = fused_step(
                    sealed.total[s],
                    factor,
                    self.optimizer.trace(self.state, s),
                    self.optimizer.momentum,
                    self.optimizer.lr,
                    self.residual[s],
                    self.theta[s],
                    self.downlink,
                    self.config.block_size,
                )
                if data is not None:
                    return codecs.Segment(s.start, s.stop - s.start, data)
            move = self.optimizer.move(self.state, sealed.outer_gradient(s.start, s.stop, scale), s)
            np.add(move, self.residual[s], out=move)  # what earlier deltas lost
            data = step_segment(
                self.theta[s], move, self.residual[s], self.downlink, self.config.block_size
            )
            return codecs.Segment(s.start, s.stop - s.start, data)

        return list(_STEP_POOL.map(one, range(0, self.size, step)))

    async def _commit(
        self,
        updates: list[Update],
        sealed: Accumulator,
        live_learners: frozenset[str] | None,
        ready: float,
    ) -> None:
        assert self.version is not None
        started = time.monotonic()
        learners = {u.learner for u in updates}
        scale = live_round_scale(learners, live_learners)
        claimed = {u: u.weight for u in updates if u.provisional}
        phases = _Phases()
        if claimed:
            await self._ahead_on_worker(self._sum_provisional, updates, sealed)
            phases.done("provisional")
            for u, weight in claimed.items():
                if u.weight < weight:
                    log.info(
                        "weight_capped", fragment=self.fragment, learner=u.learner, weight=weight
                    )
                if self.weights.get(u.learner) == weight:  # not a newer one's since
                    self.weights.set(u.learner, u.weight)
        await self._keyframe_written()
        phases.done("keyframe_wait")
        delta = await self._ahead_on_worker(self._step, sealed, scale)
        sealed.release()
        phases.done("step")
        version = self.version + 1
        job, p, e = self.store.job, self.fragment, self.epoch
        delta_name = object_name(job, p, version, e, "delta")
        # The pointer names the newest keyframe written; this version is it plus the deltas.
        frame = self.written or self.keyframes[-1]
        # The new values' checksum is taken beside the delta's write, off the worker (chunks
        # of the next round keep summing there): only a step changes theta, and the next
        # one waits for this commit (a merge that fails here loses the fragment).
        checksum = asyncio.ensure_future(asyncio.to_thread(_checksum, self.theta))
        await self.tensors.put(delta_name, await asyncio.to_thread(codecs.pack_segments, delta))
        phases.done("delta_write")
        useful = sum(u.compute_seconds for u in updates) / max(1, self.fragments)
        staleness = [self.version - u.base_version for u in updates]
        entry: dict[str, Any] = {
            "fragment": p,
            "version": version,
            "uids": [u.uid for u in updates],
            "learners": [u.learner for u in updates],
            "weights": [u.weight for u in updates],
            "clips": [u.clip for u in updates],
            "scale": scale,
            "base_versions": [u.base_version for u in updates],
            "replica": self.replica,
            "epoch": e,
            "committed_at": time.time(),
            "useful_seconds": useful,
            "delta": delta_name,
            "value": frame.value,  # the keyframe this version is rebuilt from
            "checksum": await checksum,
        }
        phases.done("checksum")  # what of the hash was left once the delta was written
        entry["latency_s"] = round(time.monotonic() - ready, 6)  # round ready to committing
        entry["phases_s"] = dict(phases.seconds)  # where its time went (so far)
        status, now_version = await self.store.commit(
            Commit(
                fragment=p,
                replica=self.replica,
                epoch=e,
                expected_version=self.version,
                value=frame.value,
                state=frame.state,
                delta=delta_name,
                merged=[(u.learner, u.incarnation, u.seq) for u in updates],
                useful_seconds=useful,
                tokens_merged=sum(u.c_tokens for u in updates) / max(1, self.fragments),
                stale_folded=sum(1 for s in staleness if s > 0),
                log_entry=entry,
            )
        )
        phases.done("commit")
        if status != "committed":
            # The in-memory state moved past what Redis holds: this owner is done with it.
            self.lost = True
            tm.MERGE_ABORTS.inc()
            log.warning("merge_aborted", fragment=p, status=status, version=now_version)
            await self.tensors.delete([delta_name])
            raise OwnerLost(f"fragment {p}: commit refused ({status})")
        self.version = version
        if frame is not self.keyframes[-1]:
            self.keyframes = [self.keyframes[-1], frame]
        self.written = None
        if (version + p) % VALUE_EVERY == 0:  # fragments take turns
            self._start_keyframe(version)
        seconds = time.monotonic() - started
        self.t_sync_s = (
            seconds if not self.t_sync_s else T_SYNC_DECAY * self.t_sync_s + 0.2 * seconds
        )
        self.opened_at, self.quorum_at, self.deadline = time.monotonic(), None, None
        self.held_at = 0.0
        for s in staleness:
            tm.STALENESS.observe(s)
        tm.QUORUM_SIZE.observe(len(learners))
        tm.MERGES.inc()
        tm.MERGE_SECONDS.observe(seconds)
        tm.FRAGMENT_VERSION.labels(fragment=str(p)).set(version)
        self.tape.write("merged", **entry)
        log.info(
            "merged",
            fragment=p,
            version=version,
            contributors=len(updates),
            seconds=round(seconds, 4),
        )
        if self._gc is None or self._gc.done():  # in the background, never in a merge's time
            self._gc = asyncio.create_task(self._collect_garbage(version))

    async def _collect_garbage(self, version: int) -> None:
        """Delete the objects no kept version is rebuilt from: keyframes older than the two
        the pointer named last (those after are being written), and deltas before the older
        of them but the last KEEP_DELTAS."""
        prefix = f"{self.store.job}/fragment-{self.fragment:05d}/"
        try:
            kept = {n for frame in self.keyframes for n in (frame.value, *frame.state)}
            oldest, newest = self.keyframes[0].version, self.keyframes[-1].version
            old = [
                n
                for n in await self.tensors.names(prefix)
                if (
                    version_of(n) <= min(oldest, version - KEEP_DELTAS)
                    if n.endswith(".delta")
                    else version_of(n) < newest and n not in kept
                )
            ]
            await self.tensors.delete(old)
        except Exception as err:  # garbage is collected next time
            log.warning("gc_failed", fragment=self.fragment, error=str(err))

    def close(self) -> None:
        if self._writing is not None:
            self._writing.cancel()
        self.worker.shutdown(wait=False, cancel_futures=True)


def _each_chunk(fn: Callable[[Chunk], None], chunks: list[Chunk]) -> None:
    """`fn` on each of one update's chunks, side by side on the step pool: they are
    disjoint ranges of values, so no two touch the same part of a sum (the worker waits
    for them: still one of the fragment's jobs at a time). A move at sealing decodes an
    update's chunks again; one after another it was most of a merge's tail."""
    if len(chunks) < 2:
        for chunk in chunks:
            fn(chunk)
        return
    list(_STEP_POOL.map(fn, chunks))


class _Phases:
    """A merge's phases, each observed as it ends (atoll_merge_phase_seconds)."""

    def __init__(self) -> None:
        self.mark = time.monotonic()
        self.seconds: dict[str, float] = {}

    def done(self, phase: str) -> None:
        now = time.monotonic()
        tm.MERGE_PHASE_SECONDS.labels(phase=phase).observe(now - self.mark)
        self.seconds[phase] = round(now - self.mark, 4)
        self.mark = now


def update_weight(c_tokens: int, c_steps: int, cap: float | None, staleness: float) -> float:
    """What an update weighs in its round: its tokens' weight (`token_weight`), at most
    `cap` (None: provisional, as claimed), times its staleness factor; never zero."""
    weight = token_weight(c_tokens, c_steps)
    if cap is not None:
        weight = min(weight, cap)
    return max(weight * staleness, 1e-30)


def step_scale(steps: int, reference_steps: int) -> float:
    """How much larger than a reference update of `reference_steps` inner steps an honest
    update of `steps` steps may be. An outer gradient's norm grows between the square root
    of its steps (noise) and linearly (a steady direction): fewer steps scale by the square
    root, more steps linearly, at most MAX_STEP_SPAN times. Steps differ between honest
    updates: a learner whose reply comes late sends more steps at once, and the one after
    it fewer."""
    x = max(1, steps) / max(1, reference_steps)
    return math.sqrt(x) if x < 1.0 else min(x, MAX_STEP_SPAN)


def _checksum(values: np.ndarray) -> int:
    """XXH3-64 of a float32 array's bytes, without copying them."""
    return codecs.checksum(np.ascontiguousarray(values, "<f4").view(np.uint8).data)


NORM_CHUNK = 1 << 20  # values widened to float64 at a time by `_norm`


def _norm(values: np.ndarray) -> float:
    """The L2 norm in float64, a chunk at a time (two float64 copies of a whole fragment
    were 16 bytes a value of transient memory for every fragment an owner loads)."""
    total = 0.0
    for start in range(0, values.size, NORM_CHUNK):
        part = values[start : start + NORM_CHUNK].astype(np.float64)
        total += float(np.dot(part, part))
    return math.sqrt(total)
