"""A fragment's committed state in its owner's memory, and how a sealed round moves it: the
outer step, the commit and the garbage collection after it.

The owner holds the fragment's value, optimizer state and downlink residual. A merge steps
them in place, segment by segment on every core, and makes the downlink delta on the way;
the delta is written to the tensor store before one script in the control store checks the
fencing epoch and the version and swings the pointer (write, then swing). Objects no kept
version is rebuilt from are deleted in the background, never in a merge's time.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import structlog

from services import codec as codecs
from services import telemetry as tm
from services.config import JobConfig
from services.downlink import fused_step, step_segment
from services.tape import Tape
from synchronizer.core.merge import OuterOptimizer, RoundSum
from synchronizer.records import OwnerLost, Update
from synchronizer.store.control import Commit, ControlStore, Pointer
from synchronizer.store.tensors import TensorStore, object_name, version_of
from synchronizer.summing import STEP_POOL
from synchronizer.values import VALUE_EVERY, Keyframes, value_at

log = structlog.get_logger("atoll.synchronizer.commit")
# Kept in the tensor store after a commit: the keyframe the pointer names and the one before
# (a fetch may still be reading it), every delta after the older of them, and at least the
# last KEEP_DELTAS deltas (what catches a learner up). A merge writes its delta before the
# pointer moves; a keyframe (value, optimizer state, residual) every VALUE_EVERY-th version,
# in the background (values.py).
KEEP_DELTAS = 10
T_SYNC_DECAY = 0.8
NORM_CHUNK = 1 << 20  # values widened to float64 at a time by `norm_of`

Ahead = Callable[..., Awaitable[Any]]  # a job on the fragment's worker, ahead of the sums


class Phases:
    """A merge's phases, each observed as it ends (atoll_merge_phase_seconds)."""

    def __init__(self) -> None:
        self.mark = time.monotonic()
        self.seconds: dict[str, float] = {}

    def done(self, phase: str) -> None:
        now = time.monotonic()
        tm.MERGE_PHASE_SECONDS.labels(phase=phase).observe(now - self.mark)
        self.seconds[phase] = round(now - self.mark, 4)
        self.mark = now


class FragmentState:
    """One owned fragment's value, optimizer state and residual at its committed version."""

    def __init__(
        self,
        *,
        fragment: int,
        size: int,
        epoch: int,
        replica: str,
        fragments: int,
        config: JobConfig,
        store: ControlStore,
        tensors: TensorStore,
        tape: Tape,
        ahead: Ahead,
    ) -> None:
        self.fragment, self.size, self.epoch, self.replica = fragment, size, epoch, replica
        self.fragments, self.config = fragments, config
        self.store, self.tensors, self.tape, self._ahead = store, tensors, tape, ahead
        self.optimizer = OuterOptimizer(config.outer_lr, config.outer_momentum)
        self.downlink = codecs.by_name(config.downlink_codec)
        self.keyframes = Keyframes(store, fragment, epoch, tensors)
        self.version: int | None = None  # None: no value yet (the job is not initialized)
        self.theta = np.zeros(0, np.float32)
        self.theta_norm = 0.0
        self.state: list[np.ndarray] = []
        self.residual = np.zeros(0, np.float32)
        # The sign of the last outer gradient this owner merged, True where positive: what
        # an update's direction is checked against (`RoundSums.agreement`). None until this
        # owner's first merge of the fragment (a new owner checks nothing before it).
        self.direction: np.ndarray | None = None
        # The slots whose updates made that direction: an update is not checked against a
        # direction its own slot's updates made alone (a slot's own history never moves its
        # bar; one learner's consecutive outer gradients are nearly uncorrelated late in
        # training, and a job of one learner dropped its honest updates).
        self.direction_from: frozenset[str] = frozenset()
        self.t_sync_s = 0.0  # the EMA of a merge's time, sealing to commit
        self._gc: asyncio.Task[None] | None = None

    async def load(self, pointer: Pointer) -> None:
        """Take the committed value (its keyframe plus the deltas since) and the keyframe's
        optimizer state and residual from the tensor store; the version last."""
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
        self.theta_norm = await asyncio.to_thread(norm_of, self.theta)
        n_opt = len(self.optimizer.init(self.theta[:0]))
        self.state = states[:n_opt] or self.optimizer.init(self.theta)
        self.residual = states[n_opt] if len(states) > n_opt else np.zeros_like(self.theta)
        self.keyframes.loaded(pointer)
        self.version = pointer.version

    async def initial_state(self, values: np.ndarray) -> tuple[str, tuple[str, ...]]:
        """Write a fragment's initial value and optimizer state; return their names."""
        arrays = [*self.optimizer.init(values), np.zeros_like(values, np.float32)]
        frame = self.keyframes.names(0, len(arrays))
        await self.keyframes.write(frame, values, arrays)
        return frame.value, frame.state

    def keeps_direction(self, sealed: RoundSum, clean: bool) -> bool:
        """Whether a round's sum's signs become the direction (`step`): the check is on,
        some member merged, and none was clipped (`clean`)."""
        return clean and sealed.weight > 0.0 and self.config.min_update_agreement > -1.0

    def step(self, sealed: RoundSum, scale: float, clean: bool = True) -> list[codecs.Segment]:
        """The outer step and the downlink delta, in place, segment by segment; segments
        are independent, so they run on every core (numpy releases the GIL). `clean`: no
        member of the round was clipped, so its sum's signs may become the direction."""
        sealed.prepare()
        step = codecs.segment_values(
            self.downlink, self.config.block_size, self.config.max_chunk_bytes
        )

        factor = sealed.gradient_factor(scale)
        # A round whose every member was dropped (sum zero) leaves the direction as it was,
        # and so does one with a clipped member: an update clipped to a few times the others'
        # norm can still outweigh them in the sum, and a direction it set would then drop
        # the honest updates after it. With the check off (--min-update-agreement -1) none
        # is kept.
        direction = None
        if self.keeps_direction(sealed, clean):
            if self.direction is None or self.direction.size != self.size:
                self.direction = np.zeros(self.size, np.bool_)
            direction = self.direction

        def one(start: int) -> codecs.Segment:
            s = slice(start, min(self.size, start + step))
            if direction is not None:  # the weights are positive: the sum's signs are its
                np.greater(sealed.total[s], 0.0, out=direction[s])
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

        return list(STEP_POOL.map(one, range(0, self.size, step)))

    async def commit(
        self,
        updates: list[Update],
        sealed: RoundSum,
        scale: float,
        ready: float,
        phases: Phases,
        started: float,
    ) -> None:
        """Step the sealed round's sum, write its delta and commit the version; OwnerLost
        when the control store refuses it (this owner's lease or version is gone).
        `ready`: when the round was ready to merge; `started`: when its merge began."""
        assert self.version is not None
        await self.keyframes.wait()
        phases.done("keyframe_wait")
        # Dropped members (clip 0) are not in the sum; clipped ones (between) are.
        clean = all(u.clip in (0.0, 1.0) for u in updates)
        keeps = self.keeps_direction(sealed, clean)
        delta = await self._ahead(self.step, sealed, scale, clean)
        if keeps:  # the round's sum's signs are the direction now
            self.direction_from = frozenset(u.learner for u in updates if u.clip > 0.0)
        sealed.release()
        phases.done("step")
        version = self.version + 1
        job, p, e = self.store.job, self.fragment, self.epoch
        delta_name = object_name(job, p, version, e, "delta")
        # The pointer names the newest keyframe written; this version is it plus the deltas.
        frame = self.keyframes.newest()
        # The new values' checksum is taken beside the delta's write, off the worker (chunks
        # of the next round keep summing there): only a step changes theta, and the next
        # one waits for this commit (a merge that fails here loses the fragment).
        checksum = asyncio.ensure_future(asyncio.to_thread(_checksum, self.theta))
        await self.tensors.put(delta_name, codecs.segment_parts(delta))
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
            "agreements": [u.agreement for u in updates],
            "shrinks": [u.shrink for u in updates],
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
            tm.MERGE_ABORTS.inc()
            log.warning("merge_aborted", fragment=p, status=status, version=now_version)
            await self.tensors.delete([delta_name])
            raise OwnerLost(f"fragment {p}: commit refused ({status})")
        self.version = version
        self.keyframes.committed(frame)
        if (version + p) % VALUE_EVERY == 0:  # fragments take turns
            self.keyframes.start(version, self.theta, [*self.state, self.residual])
        seconds = time.monotonic() - started
        self.t_sync_s = (
            seconds if not self.t_sync_s else T_SYNC_DECAY * self.t_sync_s + 0.2 * seconds
        )
        for s in staleness:
            tm.STALENESS.observe(s)
        tm.QUORUM_SIZE.observe(len({u.learner for u in updates}))
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
            named = self.keyframes.named
            kept = {n for frame in named for n in (frame.value, *frame.state)}
            oldest, newest = named[0].version, named[-1].version
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
        self.keyframes.close()


def _checksum(values: np.ndarray) -> int:
    """XXH3-64 of a float32 array's bytes, without copying them."""
    return codecs.checksum(np.ascontiguousarray(values, "<f4").view(np.uint8).data)


def norm_of(values: np.ndarray) -> float:
    """The L2 norm in float64, a chunk at a time (two float64 copies of a whole fragment
    were 16 bytes a value of transient memory for every fragment an owner loads)."""
    total = 0.0
    for start in range(0, values.size, NORM_CHUNK):
        part = values[start : start + NORM_CHUNK].astype(np.float64)
        total += float(np.dot(part, part))
    return math.sqrt(total)
