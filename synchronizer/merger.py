"""Drives rounds: decides when a fragment merges, merges it and commits under a lease.

Every replica runs one. Decisions come from `rounds.decide` over state read from the store;
the merge lease plus the version check in the commit script make sure each round commits
exactly once, whichever replica gets there first and whether or not another dies mid-merge.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import structlog

from services import codec as codecs
from services import telemetry as tm
from services.config import JobConfig
from services.downlink import encode_delta
from services.tape import Tape
from synchronizer.merge import Contribution, OuterOptimizer, merge_contributions
from synchronizer.rounds import RoundPolicy, decide
from synchronizer.store import Commit, PendingUpdate, Store

log = structlog.get_logger("atoll.synchronizer.merger")

MERGE_LEASE_S = 5.0  # renewed while a merge runs; a dead replica's lease lapses this fast
SWEEP_INTERVAL_S = 0.25


class Merger:
    def __init__(
        self,
        store: Store,
        config: JobConfig,
        replica: str,
        fragments: Callable[[], int],
        tape: Tape | None = None,
        segments: Callable[[int], list[int]] = lambda _: [],
    ) -> None:
        self._segments = segments  # a fragment's tensor sizes, in order (radial merge)
        self._store = store
        self._tape = tape or Tape(None, replica)
        self._cfg = config
        self._replica = replica
        self._fragments = fragments  # 0 until the job's spec is known
        self._policy = RoundPolicy(
            mode=config.mode,
            quorum=config.quorum,
            overlap_steps=config.overlap_steps,
            gamma=config.grace_gamma,
            fixed_grace_s=config.grace_seconds,
        )
        self.optimizer = OuterOptimizer(config.outer_lr, config.outer_momentum)
        self._downlink = codecs.by_name(config.downlink_codec)
        self._n_opt: dict[int, int] = {}
        self._timers: dict[int, asyncio.Task[None]] = {}
        self._busy: set[int] = set()

    async def sweep_forever(self) -> None:
        """Safety net: re-evaluate every fragment often, so no round is left behind by a
        replica that died holding its timer."""
        while True:
            for p in range(self._fragments()):
                try:
                    await self.evaluate(p)
                except Exception as err:  # the store may be briefly away; keep sweeping
                    log.warning("sweep_failed", fragment=p, error=str(err))
            await asyncio.sleep(SWEEP_INTERVAL_S)

    async def evaluate(self, fragment: int) -> None:
        if fragment in self._busy:
            return
        state, slowest, t_sync = await self._store.round_state(fragment)
        decision = decide(state, self._policy, slowest_step_s=slowest, t_sync_s=t_sync)
        if decision.new_deadline is not None and decision.grace_s is not None:
            await self._store.mark_quorum(fragment, decision.grace_s)
            tm.GRACE_SECONDS.observe(decision.grace_s)
        if decision.merge_now:
            await self.merge(fragment)
        elif decision.new_deadline is not None or state.deadline is not None:
            deadline = decision.new_deadline or state.deadline or state.now
            self._schedule(fragment, max(0.0, deadline - state.now))

    def _schedule(self, fragment: int, delay: float) -> None:
        timer = self._timers.get(fragment)
        if timer is not None and not timer.done():
            return

        async def fire() -> None:
            await asyncio.sleep(delay)
            await self.evaluate(fragment)

        self._timers[fragment] = asyncio.create_task(fire())

    async def merge(self, fragment: int) -> None:
        token = await self._store.acquire_merge_lease(fragment, MERGE_LEASE_S)
        if not token:
            return  # another replica is merging this fragment
        self._busy.add(fragment)
        started = time.monotonic()
        renewer = asyncio.create_task(self._renew(fragment, token))
        try:
            current = await self._store.fragment(fragment)
            pending = await self._store.pending(fragment)
            state, _, _ = await self._store.round_state(fragment)
            live = state.live_learners if self._cfg.partial_rounds == "scaled" else 0
            if not pending:
                await self._store.release_merge_lease(fragment, token)
                return
            commit = await asyncio.to_thread(
                self._compute,
                fragment,
                token,
                current.version,
                current.theta,
                current.opt_state,
                pending,
                started,
                live,
            )
            status, version = await self._store.commit(commit)
            if status != "committed":
                tm.MERGE_ABORTS.inc()
                log.info("merge_aborted", fragment=fragment, status=status, version=version)
                return
            tm.MERGES.inc()
            tm.MERGE_SECONDS.observe(time.monotonic() - started)
            self._tape.write("merged", **commit.log_entry)
            log.info(
                "merged",
                fragment=fragment,
                version=version,
                contributors=len(commit.uids),
                seconds=round(time.monotonic() - started, 4),
            )
        finally:
            renewer.cancel()
            self._busy.discard(fragment)

    async def _renew(self, fragment: int, token: int) -> None:
        while True:
            await asyncio.sleep(MERGE_LEASE_S / 3)
            if not await self._store.renew_merge_lease(fragment, token, MERGE_LEASE_S):
                return

    def _compute(
        self,
        fragment: int,
        token: int,
        version: int,
        theta: np.ndarray,
        opt_state: list[np.ndarray],
        pending: list[PendingUpdate],
        started: float,
        live_learners: int,
    ) -> Commit:
        contributions: list[Contribution] = []
        for update in pending:
            meta = update.meta
            codec = codecs.by_name(meta["codec"])
            delta = codec.decode(update.payload, int(meta["num_elements"]), int(meta["block_size"]))
            contributions.append(
                Contribution(
                    uid=update.uid,
                    learner=meta["learner"],
                    delta=delta,
                    c_steps=int(meta["c_steps"]),
                    c_tokens=int(meta["c_tokens"]),
                    base_version=int(meta["base_version"]),
                    compute_seconds=float(meta["compute_seconds"]),
                )
            )
        outer_gradient, weights, scale = merge_contributions(
            contributions,
            live_learners,
            method=self._cfg.merge,
            segments=self._segments(fragment),
            version=version,
            staleness_decay=self._cfg.staleness_decay,
        )
        # The stored state is the optimizer's leaves, then the downlink residual.
        n_opt = self._optimizer_leaves(theta)
        residual = opt_state[n_opt] if len(opt_state) > n_opt else None
        target, new_state = self.optimizer.step(theta, opt_state[:n_opt], outer_gradient)
        downlink, new_theta, residual = encode_delta(
            theta, target, residual, self._downlink, self._cfg.block_size
        )
        fragments = max(1, self._fragments())
        useful_seconds = sum(c.compute_seconds for c in contributions) / fragments
        staleness = [version - c.base_version for c in contributions]
        for s in staleness:
            tm.STALENESS.observe(s)
        tm.QUORUM_SIZE.observe(len({c.learner for c in contributions}))
        return Commit(
            fragment=fragment,
            token=token,
            expected_version=version,
            theta=new_theta,
            opt_state=[*new_state, residual],
            delta=downlink,
            uids=[c.uid for c in contributions],
            useful_seconds=useful_seconds,
            tokens_merged=sum(c.c_tokens for c in contributions) / fragments,
            stale_folded=sum(1 for s in staleness if s > 0),
            t_sync_s=time.monotonic() - started,
            log_entry={
                "fragment": fragment,
                "version": version + 1,
                "uids": [c.uid for c in contributions],
                "learners": [c.learner for c in contributions],
                "weights": weights,
                "scale": scale,
                "base_versions": [c.base_version for c in contributions],
                "replica": self._replica,
                "committed_at": time.time(),
                "useful_seconds": useful_seconds,
                "checksum": codecs.checksum(np.asarray(new_theta, "<f4").tobytes()),
            },
        )

    def _optimizer_leaves(self, theta: np.ndarray) -> int:
        """How many of a fragment's stored state arrays are the outer optimizer's."""
        if theta.size not in self._n_opt:
            self._n_opt[theta.size] = len(self.optimizer.init(theta))
        return self._n_opt[theta.size]

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
