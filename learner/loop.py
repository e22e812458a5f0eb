"""The built-in inner loop: a compiled step over all local devices, batches, evals, timing.

It knows nothing of how bytes travel: it calls the sync engine's hooks (learner/hooks.py:
join, after_step, finish, done, each with what the loop knows), and `after_step` returns the
parameters with any newly adopted global fragment written in. Its checkpoints go through the
checkpointer it shares with the engine (learner/checkpointer.py). Without an engine
(`--standalone`) it trains alone.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import structlog

from learner import mesh as meshes
from learner.checkpointer import Checkpointer
from learner.data import mean_loss, windows_digest
from learner.hooks import SyncHooks
from learner.settings import LearnerSettings
from learner.workload import Workload
from services import telemetry as tm
from services.tape import Tape

log = structlog.get_logger("atoll.learner")
EMA_DECAY = 0.9


# Steps dispatched ahead of the one whose loss the host waits for: two steps' time for a
# sync's host work (adopting a global value, queueing an update) before the device idles.
STEPS_AHEAD = 2
PROGRESS_EVERY_S = 2.0  # how often a learner rewrites its partial summary


class StepClock:
    """When each dispatched step is done on the devices, read by a thread of its own.

    The host takes a step's loss STEPS_AHEAD steps late, and may be away in between (a sync
    mode's wait for its merge, an evaluation, a fetch): a time read when it comes back would
    count that time as the steps' compute, which it is not (it is badput, or nothing).
    """

    def __init__(self) -> None:
        self._dispatched: queue.SimpleQueue[tuple[jax.Array, float] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[jax.Array, float, float] | BaseException] = (
            queue.SimpleQueue()
        )
        self.in_flight = 0
        self._thread = threading.Thread(target=self._watch, name="atoll-step-clock", daemon=True)
        self._thread.start()

    def dispatched(self, loss: jax.Array, at: float) -> None:
        """A step was dispatched at `at` (monotonic); `loss` is ready once it is done."""
        self.in_flight += 1
        self._dispatched.put((loss, at))

    def next_done(self) -> tuple[jax.Array, float, float]:
        """The oldest step in flight once it is done: (loss, dispatched at, done at). Raises
        what the step raised."""
        item = self._done.get()
        self.in_flight -= 1
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._dispatched.put(None)
        self._thread.join(timeout=60)

    def _watch(self) -> None:
        while (item := self._dispatched.get()) is not None:
            loss, at = item
            try:
                loss.block_until_ready()
            except BaseException as err:  # the host raises it when it takes the step
                self._done.put(err)
                continue
            self._done.put((loss, at, time.monotonic()))


@dataclass
class Timeline:
    started: float = field(default_factory=time.time)
    devices_done: float = 0.0  # when the devices were done with the last step taken
    progress_written: float = 0.0  # when the partial summary was last written
    losses: list[tuple[float, int, int, float]] = field(default_factory=list)
    evals: list[tuple[float, int, int, float]] = field(default_factory=list)
    badput: dict[str, float] = field(default_factory=lambda: dict.fromkeys(tm.BADPUT_SOURCES, 0.0))

    def now(self) -> float:
        return round(time.time() - self.started, 3)


def adamw(settings: LearnerSettings) -> optax.GradientTransformation:
    """The inner optimizer when the workload names none: AdamW with warm-up and cosine decay
    to a tenth of `--lr` over `--lr-horizon-steps` (default `--steps`), each step's gradient
    first clipped to the global norm `--clip-norm` (0: not clipped)."""
    steps = settings.lr_horizon_steps or settings.steps or 1_000_000
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        settings.lr,
        max(1, settings.warmup_steps),
        max(steps, settings.warmup_steps + 1),
        end_value=settings.lr * 0.1,
    )
    adam = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=settings.weight_decay)
    if not settings.clip_norm:
        return adam
    return optax.chain(clip_to_global_norm(settings.clip_norm), adam)


def clip_to_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Scales a gradient whose global L2 norm is above `max_norm` down to that norm: every leaf
    times `min(1, max_norm / norm)`, what `optax.clip_by_global_norm` gives. That one selects
    between the clipped and the unclipped tree, which XLA's CPU code does not fuse: on the
    race's 6.1M-parameter model (one thread) a step took 78 ms with it, 50 ms with this and
    45 ms unclipped."""

    def update(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        leaves = jax.tree.leaves(updates)
        norm = jnp.sqrt(sum(jnp.vdot(x, x).real for x in leaves))
        scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30))
        return jax.tree.map(lambda x: (x * scale).astype(x.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


class InnerLoop:
    """Trains `workload` with its optimizer, calling `sync`'s hooks after every step;
    `checkpoints`, shared with `sync`, writes the slot's local checkpoints."""

    def __init__(
        self,
        settings: LearnerSettings,
        workload: Workload,
        sync: SyncHooks | None,
        tape: Tape,
        stop_requested: threading.Event,
        checkpoints: Checkpointer | None = None,
    ) -> None:
        self.settings = settings
        self.workload = workload
        self.sync = sync
        self.checkpoints = checkpoints
        self.tape = tape
        self.stop_requested = stop_requested
        self.incarnation = sync.incarnation if sync is not None else uuid.uuid4().hex
        self.timeline = Timeline()
        self.step = 0
        self.tokens = 0
        self.ema_step_s = 0.0
        self.steady = (0, 0.0)  # steps and seconds from the --rate-after-steps-th on
        self.loss = math.nan
        self.eval_loss = math.nan
        self._position_saved = time.monotonic()
        self._placed = False  # the loop knows its place (step, data position): saving it is safe
        self._drawn_ahead = 0  # batches drawn for steps not yet run (the loop draws one ahead)
        self.tx = workload.optimizer if workload.optimizer is not None else adamw(settings)
        mesh = meshes.learner_mesh()
        devices = mesh.devices.size
        if settings.batch_size % devices:
            raise ValueError(
                f"--batch-size {settings.batch_size} must be a multiple of the learner's "
                f"{devices} devices, so each gets an equal share"
            )
        # The batch split over the devices; parameters and optimizer state split as it is
        # (sharded) or whole on each device (replicated), as --param-layout says.
        shapes, layout = workload.shapes(), settings.param_layout
        self.replicated = meshes.replicated(mesh)
        self.batch_sharding = meshes.batch_sharding(mesh)
        self.param_shardings = meshes.shardings(shapes, mesh, layout)
        self.opt_shardings = meshes.shardings(jax.eval_shape(self.tx.init, shapes), mesh, layout)

    # --- set-up ---------------------------------------------------------------------------
    def _compile(self) -> None:
        loss_fn, tx = self.workload.loss_fn, self.tx

        def train_step(params: Any, opt_state: Any, batch: jax.Array) -> Any:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._train_step: Any = jax.jit(
            train_step,
            donate_argnums=(0, 1),
            out_shardings=(self.param_shardings, self.opt_shardings, self.replicated),
        )
        self._eval_loss = jax.jit(loss_fn)
        self._init_opt = jax.jit(tx.init, out_shardings=self.opt_shardings)

    def _compile_step(self, params: Any, opt_state: Any) -> None:
        """Trace and compile the inner step ahead of the first one (from the compile cache
        when it has it), so no step's measured compute time includes compiling: that time is
        start-up badput, never useful seconds."""
        t0 = time.monotonic()
        window = self.workload.batches.next()
        self.workload.batches.position -= 1  # only its shape was needed
        batch = jax.ShapeDtypeStruct(  # type: ignore[no-untyped-call]
            window.shape, window.dtype, sharding=self.batch_sharding
        )
        self._train_step = self._train_step.lower(params, opt_state, batch).compile()
        self._badput("compile", time.monotonic() - t0)

    def _start(self) -> tuple[Any, Any]:
        """Parameters (joined, or made alone; restored from the slot's checkpoint, if the
        engine found one) and the optimizer state."""
        self._load_position()
        if self.sync is None:
            params = jax.device_put(self.workload.initial(), self.param_shardings)
            log.info("standalone", learner=self.settings.id)
        else:
            params = self.sync.join(
                self.workload.make, self.param_shardings, step=self.step, tokens=self.tokens
            )
        self._compile()
        restored = None if self.checkpoints is None else self.checkpoints.restored
        self._placed = True
        if restored is None:
            return params, self._init_opt(params)
        structure = jax.tree.structure(jax.eval_shape(self.tx.init, restored.params))
        opt_state = jax.device_put(
            jax.tree.unflatten(structure, list(restored.opt_leaves)), self.opt_shardings
        )
        self.step, self.tokens = int(restored.meta["step"]), int(restored.meta["tokens"])
        self.workload.batches.position = int(restored.meta["position"])
        return restored.params, opt_state

    # --- the loop -------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        start = time.monotonic()
        params, opt_state = self._start()
        self._badput("startup", time.monotonic() - start)
        self._compile_step(params, opt_state)
        clock = StepClock()
        try:
            return self._steps(params, opt_state, clock)
        finally:
            clock.close()

    def _steps(self, params: Any, opt_state: Any, clock: StepClock) -> dict[str, Any]:
        steps = self.settings.steps
        # The training rate as it runs: steps and wall time from the --rate-after-steps-th on,
        # every hook and checkpoint included (what `atoll bench mfu` compares).
        steady: tuple[int, float] | None = None
        # Pipelined: step N+STEPS_AHEAD is dispatched (and its batch copied in) before the
        # host waits for step N's loss, so the device never idles while Python prepares a
        # step or a sync's host work runs. A step's loss and time are recorded once it is
        # done, STEPS_AHEAD steps late.
        batch = self._next_batch()
        self._drawn_ahead = 1  # one batch is always drawn before the step that trains it
        # A learner standing in for slower hardware (--speed) waits after each step; steps
        # queued ahead would run through that wait and make it faster than it stands for.
        ahead = STEPS_AHEAD if self.settings.speed >= 1.0 else 1
        done_at = self.timeline.devices_done = time.monotonic()
        seen = 0  # steps this loop took
        while not self.stop_requested.is_set() and (not steps or self.step < steps):
            if steady is None and seen >= self.settings.rate_after_steps:
                steady = (self.step, time.monotonic())
            seen += 1
            if self.sync is not None and self.sync.job_finished():
                log.info("job_budget_reached", learner=self.settings.id, step=self.step)
                break
            dispatched = time.monotonic()
            params, opt_state, loss = self._train_step(params, opt_state, batch)
            batch = self._next_batch()
            self.step += 1
            self.tokens += self.workload.tokens_per_batch
            clock.dispatched(loss, dispatched)
            seconds = 0.0
            if clock.in_flight > ahead:
                seconds, done_at = self._step_done(clock, done_at)
            if self.sync is None:
                continue
            params = self.sync.after_step(
                self.step,
                params,
                tokens=self.workload.tokens_per_batch,
                seconds=seconds,
                loss=self.loss,
                eval_loss=self.eval_loss,
            )
            turn = self.settings.eval_every
            if turn and self.step % turn == self.settings.eval_offset % turn:
                self._evaluate(params)
            self._maybe_checkpoint(params, opt_state)
        # The batch drawn ahead was never trained on: the next incarnation starts with it,
        # and the summary's digest of what was trained leaves it out.
        self.workload.batches.position -= 1
        self._drawn_ahead = 0
        late = 0.0  # compute of the steps taken after their hook: the final sync counts it
        while clock.in_flight:
            seconds, done_at = self._step_done(clock, done_at)
            late += seconds
        if steady is not None:
            self.steady = (self.step - steady[0], time.monotonic() - steady[1])
        if self.sync is not None:
            params = self.sync.finish(params, compute_seconds=late, eval_loss=self.eval_loss)
        self._evaluate(params)
        synced = {} if self.sync is None else self.sync.done(params, self.eval_loss)
        return self.summary(params, synced)

    def _next_batch(self) -> jax.Array:
        """The next batch, on its way to the devices (the copy does not block)."""
        return meshes.put(self.workload.batches.next(), self.batch_sharding)

    def _step_done(self, clock: StepClock, since: float) -> tuple[float, float]:
        """Wait for the oldest dispatched step (`clock.in_flight` were dispatched with it and
        after it); record it. Returns the step's seconds and when it was done.

        A step's seconds run from when the devices could start it (the step before it was
        done, or its dispatch, if later) to when they were done with it, as the clock's
        thread saw it: the time the host was away in between (a sync mode's wait for its
        merge, an evaluation) is no step's compute. With --speed below 1, a step ends 1/speed
        times its devices' time after it could start (`since`: the step before it ended)."""
        loss, dispatched, done = clock.next_done()
        later = clock.in_flight
        self.loss = float(loss)
        # What the devices spent on it: from when they could start it to when they were done.
        seconds = max(0.0, done - max(self.timeline.devices_done, dispatched))
        self.timeline.devices_done = done
        if self.settings.speed < 1.0:  # stand-in for slower hardware: 1/speed times as long
            seconds /= self.settings.speed
            done = max(since, dispatched) + seconds
            time.sleep(max(0.0, done - time.monotonic()))
        self._record_step(self.step - later, seconds)
        return seconds, done

    def _record_step(self, done: int, seconds: float) -> None:
        self.ema_step_s = (
            seconds
            if not self.ema_step_s
            else (EMA_DECAY * self.ema_step_s + (1 - EMA_DECAY) * seconds)
        )
        tm.LEARNER_STEPS.inc()
        tm.LEARNER_TOKENS.inc(self.workload.tokens_per_batch)
        tm.LEARNER_STEP_SECONDS.observe(seconds)
        tm.LEARNER_LOSS.set(self.loss)
        if done % max(1, self.settings.log_every) == 0 or done == 1:
            self.timeline.losses.append((self.timeline.now(), done, self.tokens, self.loss))
            self._write_progress()
        self.tape.write("step", step=done, seconds=round(seconds, 6))

    def _maybe_checkpoint(self, params: Any, opt_state: Any) -> None:
        """A checkpoint every --checkpoint-every steps, at most one per
        --checkpoint-seconds, never queued behind one still being written; without
        checkpoints, the read position every --heartbeat-s."""
        if not self.settings.checkpoint_every:
            if time.monotonic() - self._position_saved >= self.settings.heartbeat_s:
                self.save_position()
            return
        if self.checkpoints is not None and self.checkpoints.due(self.step):
            meta = {"step": self.step, "tokens": self.tokens, "position": self.trained_position}
            self.checkpoints.write(params, opt_state, meta)

    def _evaluate(self, params: Any) -> None:
        """Eval loss of the global model as this learner last saw it (standalone: its own)."""
        if self.sync is not None:
            params = self.sync.global_params(self.param_shardings)
        self.eval_loss = mean_loss(
            lambda b: float(self._eval_loss(params, self._eval_batch(b))),
            self.workload.eval_batches,
        )
        tm.LEARNER_EVAL_LOSS.set(self.eval_loss)
        self.timeline.evals.append((self.timeline.now(), self.step, self.tokens, self.eval_loss))

    def _eval_batch(self, batch: np.ndarray) -> jax.Array:
        """An eval batch on the devices: split like training batches, or, when the devices
        do not divide it (the last, short one), whole on each."""
        even = len(batch) % self.batch_sharding.mesh.devices.size == 0
        return meshes.put(batch, self.batch_sharding if even else self.replicated)

    def _badput(self, source: str, seconds: float) -> None:
        self.timeline.badput[source] += seconds
        tm.BADPUT_SECONDS.labels(source=source).inc(seconds)

    def _write_progress(self) -> None:
        """This incarnation's summary so far, at --report, marked `partial`: a killed
        incarnation leaves its losses behind for the run's summary and plot (the final
        summary replaces it)."""
        if self.settings.report is None:
            return
        if time.monotonic() - self.timeline.progress_written < PROGRESS_EVERY_S:
            return  # the file grows with the run: rewrite it now and then, not every point
        self.timeline.progress_written = time.monotonic()
        progress = {
            "learner": self.settings.id,
            "incarnation": self.incarnation,
            "partial": True,
            "steps": self.step,
            "tokens": self.tokens,
            "started_at": self.timeline.started,
            "loss": {"initial": self.timeline.losses[0][3], "final": self.loss},
            "eval_loss": self.eval_loss,
            "losses": self.timeline.losses,
            "evals": self.timeline.evals,
        }
        path = self.settings.report
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(progress))
        tmp.replace(path)

    def summary(self, params: Any, synced: dict[str, Any]) -> dict[str, Any]:
        """This incarnation's report; `synced`: the sync engine's summary ({} alone)."""
        engine_badput = synced.get("badput", {})
        badput = {k: v + engine_badput.get(k, 0.0) for k, v in self.timeline.badput.items()}
        wall = time.time() - self.timeline.started
        return {
            "learner": self.settings.id,
            "incarnation": self.incarnation,
            "steps": self.step,
            "tokens": self.tokens,
            "parameters": sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params)),
            "param_layout": self.settings.param_layout,
            "wall_seconds": round(wall, 3),
            "started_at": self.timeline.started,
            "step_time_ema_s": self.ema_step_s,
            "steady": {"steps": self.steady[0], "seconds": round(self.steady[1], 6)},
            "loss": {
                "initial": self.timeline.losses[0][3] if self.timeline.losses else None,
                "final": self.loss,
            },
            "eval_loss": self.eval_loss,
            "losses": self.timeline.losses,
            "evals": self.timeline.evals,
            "badput_seconds": badput,
            "versions": synced.get("versions", []),
            "checksums": synced.get("checksums", []),
            "bytes": synced.get("bytes", {"up": 0, "down": 0}),
            "reconnects": synced.get("reconnects", 0),
            "data_position": self.workload.batches.position,
            "data": self.data_summary(),
            **({"shards": synced["shards"]} if "shards" in synced else {}),
        }

    @property
    def trained_position(self) -> int:
        """Batches drawn and trained on (the loop draws one ahead of its step)."""
        return self.workload.batches.position - self._drawn_ahead

    def data_summary(self) -> dict[str, Any]:
        """What this learner trained and was scored on: how its text was read, and digests of
        the windows of its batches so far and of its evaluation windows
        (`learner.data.combine_digests` adds learners' digests into a run's fingerprint)."""
        rows = [row for batch in self.workload.eval_batches for row in batch]
        return {
            **self.workload.data_facts,
            "trained": self.workload.batches.digest(),
            "evaluated": windows_digest(np.asarray(rows)) if rows else None,
        }

    # --- where a learner slot stands: survives restarts ------------------------------------
    def _position_file(self) -> Path | None:
        state_dir = self.settings.state_dir
        if state_dir is None or jax.process_index():  # one learner, one file: process 0's
            return None
        return state_dir / f"{self.settings.id}.position.json"

    def _load_position(self) -> None:
        """A new incarnation of this slot goes on from where the last one stopped: the same
        step count (toward --steps) and the same place in its data shard."""
        path = self._position_file()
        if path is None or not path.exists():
            return
        saved = json.loads(path.read_text())
        self.workload.batches.position = int(saved["position"])
        self.step, self.tokens = int(saved["step"]), int(saved["tokens"])
        log.info(
            "resumed",
            learner=self.settings.id,
            step=self.step,
            position=self.workload.batches.position,
        )

    def save_position(self) -> None:
        """Write where this slot stands; nothing before the loop has its place (an
        incarnation stopped while joining must not overwrite the last one's with zeros)."""
        self._position_saved = time.monotonic()
        path = self._position_file()
        if path is None or not self._placed:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        state = {"position": self.trained_position, "step": self.step, "tokens": self.tokens}
        tmp.write_text(json.dumps(state))
        tmp.replace(path)
