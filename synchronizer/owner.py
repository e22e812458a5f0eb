"""A fragment's owner: admits updates into the open round as their chunks arrive, records
them, decides when the round merges, and has it committed.

One replica owns a fragment at a time (a lease with a fencing epoch, `ownership.py`). The
owner is composed of the rooms that do the work: the round's sums, on the fragment's own
worker thread (`summing.py`); the fragment's committed state, which a merge steps and
commits (`commit.py`); the bounds on each update's weight and norm (`core/admission.py`);
and the round rule (`core/rounds.py`). Two sums at most live at once (the round being
merged, and the next one that updates arriving during the merge go to), whatever the
number of learners. An update is recorded in the control store only once all its chunks
are summed and checked; one refused after summing is taken out again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from services import codec as codecs
from services import telemetry as tm
from services.config import JobConfig
from services.tape import Tape
from synchronizer.commit import FragmentState, Phases
from synchronizer.core.admission import (
    Guards,
    claimed_norm,
    update_weight,
)
from synchronizer.core.merge import (
    REGISTRY,
    RoundSum,
    live_round_scale,
    staleness_weight,
    token_weight,
)
from synchronizer.core.open_round import OpenRound
from synchronizer.core.rounds import (
    Live,
    RoundPolicy,
    RoundState,
    RoundTimes,
    decide,
    round_state,
)
from synchronizer.records import NormTooLarge, OwnerLost, RoundBusy, Update
from synchronizer.store.control import ControlStore, Pointer
from synchronizer.store.tensors import TensorStore
from synchronizer.summing import RoundSums

log = structlog.get_logger("atoll.synchronizer.owner")
EVALUATE_EVERY_S = 0.1


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
        self.rule = REGISTRY[config.merge]
        self.policy = RoundPolicy(
            mode=config.mode,
            quorum=config.quorum,
            overlap_steps=config.overlap_steps,
            gamma=config.grace_gamma,
            fixed_grace_s=config.grace_seconds,
            max_grace_s=config.max_grace_seconds,
        )
        self.guards = Guards(config, size)
        self.sums = RoundSums(fragment, size, self.segments, self.rule, config)
        self.committed = FragmentState(
            fragment=fragment,
            size=size,
            epoch=epoch,
            replica=replica,
            fragments=fragments,
            config=config,
            store=store,
            tensors=tensors,
            tape=tape,
            ahead=self.sums.ahead,
        )
        # Whose idempotency records of this fragment each slot's are, as last recorded here.
        self.holders: dict[str, str] = {}
        # Slots whose last update of the fragment was refused for its norm: a round neither
        # waits for them nor counts them in its step (`evaluate`), so a slot refused again
        # and again neither holds rounds open nor cuts the honest learners' step. An update
        # of theirs received takes them out again.
        self.refused_for_norm: set[str] = set()
        self.open: OpenRound[Update] = OpenRound()  # received, and streaming in
        self.times = RoundTimes(time.monotonic())
        self.lost = False
        self.merging = False
        self.wake = asyncio.Event()

    @property
    def version(self) -> int | None:
        """The committed version; None: no value yet (the job is not initialized)."""
        return self.committed.version

    # --- loading ------------------------------------------------------------------------
    async def load(self, pointer: Pointer | None) -> None:
        """Take the committed state from the tensor store (nothing if none yet) and the norm
        history the fragment's updates are bounded by, as its last owner left it."""
        if pointer is None:
            return
        history = await self.store.norms(self.fragment)
        await self.committed.load(pointer)
        self.guards.theta_norm = self.committed.theta_norm
        for learner, (norm, steps) in history.items():
            self.guards.norms.set(learner, norm, steps)
        self.times.reopen(time.monotonic())
        log.info("fragment_loaded", fragment=self.fragment, version=self.version, epoch=self.epoch)

    async def initial_state(self, values: np.ndarray) -> tuple[str, tuple[str, ...]]:
        """Write a fragment's initial value and optimizer state; return their names."""
        return await self.committed.initial_state(values)

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
        cap = self.guards.weight_cap(learner)
        asked = token_weight(c_tokens, c_steps)
        if cap is not None and asked > cap:
            log.info("weight_capped", fragment=self.fragment, learner=learner, weight=asked)
        # With no cap (the fragment's first updates, or the first since this owner took it
        # over) its weight is provisional: capped against the other members of its round
        # once the round is sealed (`RoundSums.sum_provisional`), or against other learners'
        # weights if it is still arriving then (`RoundSums.move`); summed apart until then.
        staleness = 1.0
        if self.version is not None and self.config.staleness_decay != 1.0:
            staleness = staleness_weight(self.version - base_version, self.config.staleness_decay)
        bound = self.guards.norm_bound(learner, c_steps)
        claimed = claimed_norm(norms)
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
            self.sums.current,
            norm_bound=bound,
            provisional=cap is None,
            staleness=staleness,
        )
        self.open.stream(update)
        return update

    def check_norms(self, update: Update) -> None:
        """The per-tensor norms an update claimed (radial merging divides by them) must be
        the norms of what it sent."""
        if not self.rule.needs_norms:
            return
        claimed = claimed_norm(update.norms)
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
        return self.sums.add(update, offset, count, data)

    async def abandon(self, update: Update) -> None:
        """An update that will not be received (its stream broke, or it was refused): its
        chunk sums still queued add nothing, and what was summed is taken out ahead of
        queued jobs, so before any round sealed from now on moves its chunks or steps.
        Queued behind them, a merge could step a sum that still held its values."""
        if self.open.drop(update):
            update.abandoned = True
            await self.sums.ahead(self.sums.take_out, update)

    async def receive(self, update: Update, checksum: int) -> tuple[str, int]:
        """Record a whole, checked update in Redis; on any status but `received` it is taken
        out of the sum again. Returns (status, version). It runs to its end even when the
        call that sent the update is cancelled (its learner died): Redis may have recorded
        it already, and a round member Redis holds but the sums do not would never merge."""
        return await asyncio.shield(self._receive(update, checksum))

    async def _receive(self, update: Update, checksum: int) -> tuple[str, int]:
        await self._moved(update)  # the weight recorded is the one it is summed at
        await self._check_size(update)
        await self._check_direction(update)
        bound = self.guards.clip_bound(update.learner, update.c_steps)
        if update.clip > 0.0 and update.norm > bound:  # a dropped one has nothing summed to clip
            # Scaled down, not refused: an honest update outgrowing the others' (warm-up,
            # a late reply covering many steps) still brings its direction.
            await self.sums.ahead(self.sums.clip, update, bound / update.norm)
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
            self.sums.counted(update)
        self.refused_for_norm.discard(update.learner)
        if update.clip > 0.0:  # a dropped one (direction or size) moves no bar
            # As capped (provisional: as claimed); its norm as it merges.
            self.guards.weights.set(update.learner, update.weight)
            self.guards.norms.set(update.learner, update.norm * update.clip, update.c_steps)
        self.open.receive(update)  # of the open round: one sealed meanwhile moved it
        self.times.last_received = time.monotonic()
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

    async def _check_direction(self, update: Update) -> None:
        """Measure a whole update's agreement with the fragment's last merged outer gradient
        and with the fragment's own values, in one sampled pass; below
        --min-update-agreement, or over --max-shrink-agreement (it moves the fragment toward
        zero), take it out of its sum: it is recorded and counts as its round's member at no
        weight, standing for nothing (`live_round_scale`). The direction is not checked before
        this owner's first merge; the shrink is, from the fragment's first update on. Only
        toward zero: early in training honest updates grow the fragment (their agreement
        with it reaches -0.5 on the byzantine bench), and an update that grows it more than
        honest ones do is bounded by its norm. Nor is the direction checked where the last
        one was made by this update's slot alone (`FragmentState.direction_from`)."""
        if update.clip == 0.0:
            return
        floor, shrink_bound = self.config.min_update_agreement, self.config.max_shrink_agreement
        direction = self.committed.direction if floor > -1.0 else None
        if self.committed.direction_from <= {update.learner}:
            direction = None  # made by this slot's own updates alone: not its bar
        theta = self.committed.theta if shrink_bound < 1.0 else None
        if theta is not None and theta.size != self.committed.size:
            theta = None  # no value yet: the job is not initialized
        if direction is None and theta is None:
            return
        update.agreement, update.shrink = await self.sums.ahead(
            self.sums.agreement, update, direction, theta
        )
        if update.agreement is not None and update.agreement < floor:
            await self._drop(update, "direction", agreement=round(update.agreement, 4))
        elif update.shrink is not None and update.shrink > shrink_bound:
            await self._drop(update, "shrink", shrink=round(update.shrink, 4))

    async def _check_size(self, update: Update) -> None:
        """A whole update over `Guards.drop_bound` (--max-update-norm-ratio times the other
        slots' recent norms) is taken out of its sum and merged at no weight, as its round's
        member."""
        bound = self.guards.drop_bound(update.learner, update.c_steps)
        if bound is not None and update.norm > bound:
            await self._drop(update, "norm", norm=update.norm, bound=bound)

    async def _drop(self, update: Update, reason: str, **why: float) -> None:
        """Take a whole update out of its sum: recorded, a member of its round that stands
        for nothing (`live_round_scale`), merged at no weight (its clip 0). `reason`:
        direction, shrink or norm."""
        await self.sums.ahead(self.sums.take_out, update)
        update.clip = 0.0
        self._count_drop(update, reason, **why)

    def _count_drop(self, update: Update, reason: str, **why: float) -> None:
        tm.UPDATES_DROPPED.labels(reason=reason).inc()
        log.info(
            "update_dropped", fragment=self.fragment, learner=update.learner, reason=reason, **why
        )

    @staticmethod
    async def _moved(update: Update) -> None:
        """Once the update's last move to a newer round (which may settle its provisional
        weight) has run on the worker."""
        while update.moved is not None and not update.moved.done():
            await asyncio.wrap_future(update.moved)

    async def _record(
        self, update: Update, checksum: int, record: dict[str, Any]
    ) -> tuple[str, int]:
        """Record the update in the control store (`store/lua/receive.lua`). The slot's
        idempotency records of this fragment are one incarnation's: while they are this
        update's (as far as this owner knows), one call; else only the slot's current
        incarnation (the last to say hello) may take their place, looked up first."""

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
                # One merged at no weight (dropped) leaves its slot's entry as it was.
                norm=(update.norm * update.clip, update.c_steps) if update.clip > 0 else None,
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
        return round_state(
            live,
            fragment=self.fragment,
            size=self.size,
            contributors=self.open.contributors(),
            sending=self.open.sending(),
            streaming=[u for u in self.open.in_flight if u.accumulator is self.sums.current],
            first_update_at=min((u.first_at for u in self.open.members), default=None),
            times=self.times,
            now=now,
            inner_steps=self.config.inner_steps,
        )

    async def evaluate(self, live: Live) -> None:
        """Decide on the open round; merge it when the rule says so. A slot whose last
        update was refused for its norm is not waited for, nor counted in the step: in sync
        mode too, whose rounds otherwise wait for every slot of the job (a slot sending only
        refused updates would stop the job)."""
        if self.version is None or self.merging or self.lost or not self.open.members:
            return
        policy = self.policy
        if self.refused_for_norm:
            kept = tuple(lv for lv in live.learners if lv.learner not in self.refused_for_norm)
            live = Live(live.now_s, kept)
            if policy.mode == "sync":  # its quorum is the job's M: those slots are not in it
                quorum = max(1, policy.quorum - len(self.refused_for_norm))
                policy = dataclasses.replace(policy, quorum=quorum)
        now = time.monotonic()
        state, slowest = self.round_state(live, now)
        decision = decide(state, policy, slowest_step_s=slowest, t_sync_s=self.committed.t_sync_s)
        self.times.decided(decision, now)
        if decision.grace_s is not None:
            tm.GRACE_SECONDS.observe(decision.grace_s)
        if decision.merge_now:
            scaled = self.config.partial_rounds == "scaled"
            await self.merge(frozenset(lv.learner for lv in live.learners) if scaled else None)

    def refused(self, learner: str, reason: str) -> None:
        """An update of `learner` was refused for `reason` (telemetry.REJECT_REASONS)."""
        if reason == "norm":
            self.refused_for_norm.add(learner)

    async def merge(self, live_learners: frozenset[str] | None) -> None:
        """Seal the open round and commit it. `live_learners`: the slots with a live session
        now, which scale its step (`live_round_scale`); None: a full step."""
        self.merging = True
        ready = self.times.ready(time.monotonic())
        try:
            members, sealed = self.seal()
            if not members:
                return
            try:
                await self._commit(members, sealed, live_learners, ready)
            except OwnerLost:
                self.lost = True  # the commit was refused: the in-memory state moved past it
                raise
            except asyncio.CancelledError:
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

    def seal(self) -> tuple[list[Update], RoundSum]:
        """Close the round: its members and sum. Updates still arriving belong to the next
        round from now on; their chunks summed so far move there (queued on the worker
        before the merge's own job)."""
        sealed = self.sums.seal()
        members = self.open.seal()  # once the next sum is made: a failure leaves the round
        for update in self.open.in_flight:
            if update.accumulator is sealed:
                update.accumulator = self.sums.current
                # Weights are read here, on the event loop; the update changes on the worker.
                cap = self.guards.weight_cap(update.learner) if update.provisional else None
                update.moved = self.sums.worker.urgent(self.sums.move, update, sealed, cap)
        return members, sealed

    async def _commit(
        self,
        updates: list[Update],
        sealed: RoundSum,
        live_learners: frozenset[str] | None,
        ready: float,
    ) -> None:
        """The sealed round's provisional weights settled and summed in, then its step
        committed (`FragmentState.commit`); the next round opens."""
        started = time.monotonic()
        claimed = {u: u.weight for u in updates if u.provisional}
        clips = {u: u.clip for u in claimed}
        phases = Phases()
        if claimed:
            await self.sums.ahead(self.sums.sum_provisional, updates, sealed)
            phases.done("provisional")
            for u, weight in claimed.items():
                if u.weight < weight:
                    log.info(
                        "weight_capped", fragment=self.fragment, learner=u.learner, weight=weight
                    )
                if self.guards.weights.get(u.learner) == weight:  # not a newer one's since
                    self.guards.weights.set(u.learner, u.weight)
        for u in claimed:  # clipped again at sealing (`clip_against_round`)?
            if u.clip == clips[u]:
                continue
            if u.clip == 0.0:
                self._count_drop(u, "norm", norm=u.norm)
            if self.guards.norms.get(u.learner) != u.norm * clips[u]:
                continue  # a newer update of its slot's norm is kept since
            if u.clip > 0.0:
                self.guards.norms.set(u.learner, u.norm * u.clip, u.c_steps)
            else:
                self.guards.norms.discard(u.learner)  # a dropped one moves no bar
        # After the provisional members settled: one may have been dropped at sealing.
        scale = live_round_scale(
            {u.learner for u in updates},
            live_learners,
            dropped={u.learner for u in updates if u.clip == 0.0},
        )
        await self.committed.commit(updates, sealed, scale, ready, phases, started)
        self.times.reopen(time.monotonic())

    def close(self) -> None:
        self.committed.close()
        self.sums.close()
