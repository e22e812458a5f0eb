"""The learner: a JAX inner loop over all local devices, syncing fragments in the background.

The inner loop never waits on the network in decoupled mode: encoded fragments are queued
for the session thread, and new global values are applied between two steps. In sync mode
the learner waits at each fragment sync until that fragment is merged (classic DiLoCo).
"""

from __future__ import annotations

import json
import math
import queue
import signal
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import optax
import structlog
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from learner import checkpoint as ckpt
from learner.client import GlobalFragment, SynchronizerClient
from learner.outer import OuterState, due_fragments, sync_round
from learner.settings import LearnerSettings
from learner.workload import Named, Workload
from services import codec as codecs
from services import telemetry as tm
from services.config import INIT_CLAIM_S
from services.gen.atoll.v1 import session_pb2
from services.layout import FragmentLayout, LeafSpec, fragment_layout
from services.tape import Tape

log = structlog.get_logger("atoll.learner")
FINAL_SYNC_TIMEOUT_S = 120.0
INIT_POLL_S = 0.2  # how often a learner waiting for the job's initial parameters asks
EMA_DECAY = 0.9


@dataclass
class Timeline:
    started: float = field(default_factory=time.time)
    losses: list[tuple[float, int, int, float]] = field(default_factory=list)
    evals: list[tuple[float, int, int, float]] = field(default_factory=list)
    badput: dict[str, float] = field(default_factory=lambda: dict.fromkeys(tm.BADPUT_SOURCES, 0.0))

    def now(self) -> float:
        return round(time.time() - self.started, 3)


class Learner:
    def __init__(self, settings: LearnerSettings, workload: Workload) -> None:
        self.s = settings
        self.w = workload
        self.incarnation = uuid.uuid4().hex
        shapes = workload.shapes()
        self.named = Named.of(shapes)
        self.specs = [
            LeafSpec(n, tuple(int(d) for d in v.shape), "float32")
            for n, v in self.named.flatten(shapes).items()
        ]
        self.timeline = Timeline()
        tm.LEARNER_PARAMETERS.set(sum(s.size for s in self.specs))
        self.tape = Tape(settings.tape, settings.id)
        self._reconnects_seen = 0
        self._provisioned_until = time.monotonic()
        self.stop_requested = threading.Event()
        self.step = 0
        self.tokens = 0
        self.ema_step_s = 0.0
        self.loss = math.nan
        self.eval_loss = math.nan
        self.pending_acks: dict[int, tuple[int, float]] = {}  # seq -> (fragment, compute s)
        # Encoding and queueing updates happen here, off the inner loop; one thread keeps
        # each fragment's error feedback in order.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atoll-encode")
        self._encoding: list[Future[tuple[int, int, float]]] = []
        self._writing: Future[tuple[int, int, float]] | None = None  # the last checkpoint
        self._last_checkpoint = -math.inf  # when it was taken (monotonic)
        self._slots: ckpt.Slots | None = None
        self._refetch: set[int] = set()
        devices = jax.devices()
        if settings.batch_size % len(devices):
            raise ValueError(
                f"--batch-size {settings.batch_size} must be a multiple of the {len(devices)} "
                "local devices, so each gets an equal share"
            )
        # Auto axes: XLA propagates the batch sharding through the model (plain data parallel).
        mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Auto,))
        self.replicated = NamedSharding(mesh, P())  # type: ignore[no-untyped-call]
        self.batch_sharding = NamedSharding(mesh, P("data"))  # type: ignore[no-untyped-call]
        self.client = SynchronizerClient(
            [a for addr in settings.synchronizer for a in addr.split(",") if a],
            job=settings.job,
            learner_id=settings.id,
            incarnation=self.incarnation,
            params=self.specs,
            token=settings.token,
            max_backoff_s=settings.max_backoff_s,
        )

    # --- set-up ---------------------------------------------------------------------------
    def join(self) -> None:
        welcome = self.client.connect()
        cfg = welcome.config
        self.mode, self.alpha = cfg.mode, cfg.merge_alpha
        self.P, self.H = cfg.fragments, cfg.inner_steps
        self.codec = codecs.by_wire(cfg.codec)
        self.block_size = cfg.block_size
        self.layout: FragmentLayout = fragment_layout(self.specs, self.P)
        # Fragments still at the value this learner initialized (same model and seed) are
        # not sent again: only their checksums travel. Once the job has moved on, this
        # learner's initial values can match nothing: they are not even made.
        mine: dict[int, np.ndarray] = {}
        if not welcome.initialized or not any(welcome.versions):
            made = self.named.flatten(self.w.initial()).items()
            flat = {k: np.asarray(v, np.float32) for k, v in made}
            mine = {p: self.layout.gather(p, flat) for p in range(self.P)}
        fetched: list[GlobalFragment] | None = None
        if not welcome.initialized and not welcome.initializer:
            fetched = self._await_initial(mine)  # another learner is sending them
        if not welcome.initialized and fetched is None:
            for p in range(self.P):
                self.client.send_initial(p, mine[p])
            deadline = time.monotonic() + 60
            while self.client.unacked() and time.monotonic() < deadline:
                self.client.check()
                time.sleep(0.05)
        if fetched is None:
            fetched = self.client.fetch_state(held=mine)
        globals_ = sorted(fetched, key=lambda g: g.fragment)
        if len(globals_) != self.P:
            raise RuntimeError(f"fetched {len(globals_)} of {self.P} global fragments; retry")
        self.outer = OuterState.start(
            [(g.version, g.values) for g in globals_],
            self.codec,
            self.block_size,
            keep_progress=cfg.keep_overlap_progress,
        )
        flat = {}
        for g in globals_:
            flat.update(self.layout.scatter(g.fragment, g.values))
        self.params = jax.device_put({k: jnp.asarray(v) for k, v in flat.items()}, self.replicated)
        tm.REJOINS.inc()
        log.info(
            "joined",
            learner=self.s.id,
            incarnation=self.incarnation,
            mode=self.mode,
            fragments=self.P,
            inner_steps=self.H,
            codec=self.codec.name,
            versions=[g.version for g in globals_],
            initialized_job=not welcome.initialized,
        )

    def _await_initial(self, mine: dict[int, np.ndarray]) -> list[GlobalFragment] | None:
        """The job's initial values, once the learner holding the claim has sent them; None
        if they did not come while its claim lasted (then this learner sends its own)."""
        deadline = time.monotonic() + INIT_CLAIM_S + 5.0
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            try:
                return self.client.fetch_state(held=mine)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
            time.sleep(INIT_POLL_S)
        log.warning("initial_parameters_late", learner=self.s.id)
        return None

    def compile(self) -> None:
        named, loss_fn = self.named, self.w.loss_fn
        steps = self.s.lr_horizon_steps or self.s.steps or 1_000_000
        schedule = optax.warmup_cosine_decay_schedule(
            0.0,
            self.s.lr,
            max(1, self.s.warmup_steps),
            max(steps, self.s.warmup_steps + 1),
            end_value=self.s.lr * 0.1,
        )
        self.tx = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=self.s.weight_decay)
        tx = self.tx

        def flat_loss(params: dict[str, jax.Array], batch: jax.Array) -> jax.Array:
            return loss_fn(named.unflatten(params), batch)

        def train_step(params: Any, opt_state: Any, batch: jax.Array) -> Any:
            loss, grads = jax.value_and_grad(flat_loss)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._train_step: Any = jax.jit(train_step, donate_argnums=(0, 1))
        self._eval_loss = jax.jit(flat_loss)

    def _compile_step(self) -> None:
        """Trace and compile the inner step ahead of the first one (from the compile cache
        when it has it), so no step's measured compute time includes compiling: that time is
        start-up badput, never useful seconds."""
        t0 = time.monotonic()
        window = self.w.batches.next()
        self.w.batches.position -= 1  # only its shape was needed
        batch = jax.ShapeDtypeStruct(  # type: ignore[no-untyped-call]
            window.shape, window.dtype, sharding=self.batch_sharding
        )
        self._train_step = self._train_step.lower(self.params, self.opt_state, batch).compile()
        self._badput("compile", time.monotonic() - t0)

    # --- the loop -------------------------------------------------------------------------
    def start_alone(self) -> None:
        """--standalone: no synchronizer, the inner loop only (the overlap baseline)."""
        flat = self.named.flatten(self.w.initial())
        self.params = jax.device_put(dict(flat), self.replicated)
        log.info("standalone", learner=self.s.id)

    def run(self) -> dict[str, Any]:
        start = time.monotonic()
        if self.s.standalone:
            self.start_alone()
        else:
            self.join()
        self.compile()
        restored = not self.s.standalone and self._restore()
        if not restored:
            self.opt_state = jax.device_put(self.tx.init(self.params), self.replicated)
            self._load_position()
        self._badput("startup", time.monotonic() - start)
        if not self.s.standalone:
            self._record("joined", restored=restored)
        self._compile_step()
        last_heartbeat = 0.0
        while not self.stop_requested.is_set() and (not self.s.steps or self.step < self.s.steps):
            if not self.s.standalone:
                self.client.check()
                if self.client.job_finished:
                    log.info("job_budget_reached", learner=self.s.id, step=self.step)
                    break
            t0 = time.monotonic()
            batch = jax.device_put(self.w.batches.next(), self.batch_sharding)
            self.params, self.opt_state, loss = self._train_step(self.params, self.opt_state, batch)
            self.loss = float(loss)  # waits for the step: its time is compute time
            seconds = time.monotonic() - t0
            if self.s.speed < 1.0:  # stand-in for slower hardware
                time.sleep(seconds * (1.0 / self.s.speed - 1.0))
                seconds = time.monotonic() - t0
            self.ema_step_s = (
                seconds
                if not self.ema_step_s
                else (EMA_DECAY * self.ema_step_s + (1 - EMA_DECAY) * seconds)
            )
            self._record_step(seconds)
            self.tape.write("step", step=self.step, seconds=round(seconds, 6))
            if self.s.standalone:
                continue
            self._sync_step()
            if time.monotonic() - last_heartbeat >= self.s.heartbeat_s:
                last_heartbeat = time.monotonic()
                self._heartbeat()
        if self.s.standalone:
            self._evaluate()
        else:
            self.final_sync()
        return self.summary()

    def _record_step(self, seconds: float) -> None:
        self.step += 1
        self.tokens += self.w.tokens_per_batch
        tm.LEARNER_STEPS.inc()
        tm.LEARNER_TOKENS.inc(self.w.tokens_per_batch)
        tm.LEARNER_STEP_SECONDS.observe(seconds)
        tm.LEARNER_LOSS.set(self.loss)
        self._last_step_s = seconds
        if self.step % max(1, self.s.log_every) == 0 or self.step == 1:
            self.timeline.losses.append((self.timeline.now(), self.step, self.tokens, self.loss))

    def _sync_step(self) -> None:
        """Between two steps: adopt replies, send due fragments (sync mode: wait for them)."""
        for f in self.outer.fragments:
            f.count(self.w.tokens_per_batch, self._last_step_s)
        self._apply_arrivals()
        self._drain_acks()
        for p in due_fragments(self.step, self.P, self.H):
            f = self.outer.fragments[p]
            if self.mode == "sync" and f.version >= sync_round(self.step, p, self.P, self.H):
                # An earlier incarnation of this slot already sent this round's update (it
                # was restored to a step before that send): sending again would wait for a
                # round the others reach only a full cycle later, while they wait for it.
                continue
            f.due = True
        for p, f in enumerate(self.outer.fragments):
            if f.due and not f.in_flight and f.steps:
                self._send(p)
                if self.mode == "sync":
                    self._wait_for(p, source="waiting")
        turn = self.s.eval_every
        if turn and self.step % turn == self.s.eval_offset % turn:
            self._evaluate()
        every = self.s.checkpoint_every
        due = self.s.state_dir is not None and every and self.step % every == 0
        due = due and time.monotonic() - self._last_checkpoint >= self.s.checkpoint_seconds
        if due and (self._writing is None or self._writing.done()):  # never queue them up
            self._last_checkpoint = time.monotonic()
            self._checkpoint()

    def _send(self, p: int) -> None:
        """Start fragment p's update; the encoder thread finishes and queues it."""
        f = self.outer.fragments[p]
        send = f.begin_send()
        names = [leaf.name for leaf in self.layout.fragments[p].leaves]
        # A device-side copy: the step donates the parameters' buffers to the next one.
        snapshot = [jnp.copy(self.params[n]) for n in names]

        def encode_and_queue() -> tuple[int, int, float]:
            host = dict(zip(names, jax.device_get(snapshot), strict=True))
            theta = self.layout.gather(p, host)
            seq = self.client.send_update(
                fragment=p,
                payload=f.encode(send, theta),
                codec=self.codec.wire,
                block_size=self.block_size,
                num_elements=theta.size,
                base_version=send.version,
                c_steps=send.steps,
                c_tokens=send.tokens,
                compute_seconds=send.compute_seconds,
            )
            self.tape.write(
                "sent",
                uid=self._uid(seq),
                fragment=p,
                base_version=send.version,
                steps=send.steps,
                compute_seconds=round(send.compute_seconds, 6),
            )
            return seq, p, send.compute_seconds

        self._encoding.append(self._encoder.submit(encode_and_queue))

    def _host_leaves(self, p: int) -> dict[str, np.ndarray]:
        names = [leaf.name for leaf in self.layout.fragments[p].leaves]
        return dict(zip(names, jax.device_get([self.params[n] for n in names]), strict=True))

    def _apply_arrivals(self, timeout: float = 0.0) -> bool:
        """Apply global values that arrived; return True if any reply was adopted."""
        adopted = False
        while True:
            try:
                g: GlobalFragment = self.client.fragments.get(timeout=timeout)
            except queue.Empty:
                return adopted
            timeout = 0.0
            f = self.outer.fragments[g.fragment]
            if f.receive(g.values, g.version):
                self._adopt(g.fragment, g.values, g.version)
                adopted = True

    def _adopt(self, p: int, value: np.ndarray, version: int) -> None:
        f = self.outer.fragments[p]
        needs_local = self.alpha or (f.keep_progress and f.sent_theta is not None)
        theta = self.layout.gather(p, self._host_leaves(p)) if needs_local else value
        merged = f.local_value(theta, value, self.alpha)
        f.adopt(value, version)
        for name, leaf in self.layout.scatter(p, merged).items():
            self.params[name] = jax.device_put(jnp.asarray(leaf), self.replicated)

    def _wait_for(self, p: int, source: str, timeout: float = FINAL_SYNC_TIMEOUT_S) -> None:
        """Block until fragment p's reply is adopted (sync mode, final sync)."""
        t0 = time.monotonic()
        f = self.outer.fragments[p]
        while f.in_flight and time.monotonic() - t0 < timeout:
            self.client.check()
            self._drain_acks()
            if self._apply_arrivals(timeout=0.05):
                continue
            if self.stop_requested.is_set() and source == "waiting":
                break
        self._badput(source, time.monotonic() - t0)

    def _drain_acks(self) -> None:
        still = []
        for job in self._encoding:
            if job.done():
                seq, p, compute = job.result()
                if seq >= 0:  # a checkpoint written, not an update
                    self.pending_acks[seq] = (p, compute)
            else:
                still.append(job)
        self._encoding = still
        for seq in list(self.pending_acks):
            ack = self.client.stats.acks.get(seq)
            if ack is None:
                continue
            p, compute = self.pending_acks.pop(seq)
            status = session_pb2.AckStatus.Name(ack.status).removeprefix("ACK_STATUS_").lower()
            self.tape.write("acked", uid=self._uid(seq), fragment=p, status=status)
            if ack.status in (session_pb2.ACK_STATUS_ACCEPTED, session_pb2.ACK_STATUS_DUPLICATE):
                tm.GOODPUT_SECONDS.inc(compute / self.P)
                continue
            log.warning("update_refused", fragment=p, reason=ack.reason)
            self._badput("lost", compute / self.P)
            self._refetch.add(p)  # continue from the current global value
        self._fetch_refused()

    def _fetch_refused(self) -> None:
        """Adopt the current global value of fragments whose update was refused; if no
        synchronizer answers now, the next step tries again (the session reconnects)."""
        if not self._refetch:
            return
        try:
            fetched = self.client.fetch_state(sorted(self._refetch))
        except grpc.RpcError as err:
            log.info("refetch_deferred", fragments=sorted(self._refetch), error=str(err.code()))
            return
        for g in fetched:
            self.outer.fragments[g.fragment].receive(g.values, g.version)
            self._adopt(g.fragment, g.values, g.version)
            self._refetch.discard(g.fragment)

    def _evaluate(self) -> None:
        """Eval loss of the global model as this learner last saw it (standalone: its own)."""
        params = self.params
        if not self.s.standalone:
            flat: dict[str, np.ndarray] = {}
            for p, f in enumerate(self.outer.fragments):
                newer = f.latest is not None and f.latest_version > f.version
                flat.update(self.layout.scatter(p, f.latest if newer else f.base))  # type: ignore[arg-type]
            params = jax.device_put({k: jnp.asarray(v) for k, v in flat.items()}, self.replicated)
        losses = [float(self._eval_loss(params, jnp.asarray(b))) for b in self.w.eval_batches]
        self.eval_loss = float(np.mean(losses))
        tm.LEARNER_EVAL_LOSS.set(self.eval_loss)
        self.timeline.evals.append((self.timeline.now(), self.step, self.tokens, self.eval_loss))

    def _badput(self, source: str, seconds: float) -> None:
        self.timeline.badput[source] += seconds
        tm.BADPUT_SECONDS.labels(source=source).inc(seconds)

    def _record(self, kind: str, **fields: Any) -> None:
        """A tape event with where this incarnation stands: step and fragment versions."""
        self.tape.write(
            kind,
            incarnation=self.incarnation,
            step=self.step,
            versions=[f.version for f in self.outer.fragments],
            **fields,
        )

    def _uid(self, seq: int) -> str:
        """An update's id, as the synchronizer and the commit log name it."""
        return f"{self.s.id}/{self.incarnation}/{seq}"

    def _heartbeat(
        self, done: bool = False, last_sent: bool = False, still_to_send: list[int] | None = None
    ) -> None:
        if self.client.stats.reconnects != self._reconnects_seen:
            self._reconnects_seen = self.client.stats.reconnects
            self.tape.write("reconnected", reconnects=self._reconnects_seen)
        now = time.monotonic()
        tm.PROVISIONED_SECONDS.inc(now - self._provisioned_until)
        self._provisioned_until = now
        elapsed = max(1e-9, time.time() - self.timeline.started)
        self.client.heartbeat(
            step=self.step,
            step_time_ema_s=self.ema_step_s,
            tokens_per_s=self.tokens / elapsed,
            loss=self.loss,
            eval_loss=self.eval_loss,
            done=done,
            last_sent=last_sent,  # the synchronizer takes `done` as saying it too
            still_to_send=still_to_send,
        )
        if not self.s.checkpoint_every:  # a checkpoint holds the position too
            self._save_position()

    # --- the end --------------------------------------------------------------------------
    def final_sync(self) -> None:
        """Send what every fragment learned since its anchor and adopt the replies.

        Fragments with nothing in flight go at once. One whose update is still in flight
        sends its later steps once the reply is in. After each send the learner says, in a
        heartbeat behind the updates on the stream, which fragments it will still send: the
        synchronizer merges a round as soon as no live learner can add to it, instead of
        waiting out a quorum or a grace window that nothing more will fill.
        """
        fragments = self.outer.fragments
        for p, f in enumerate(fragments):
            if f.steps and not f.in_flight:
                self._send(p)
        later = [p for p, f in enumerate(fragments) if f.in_flight and f.steps]
        while later:
            wait(self._encoding)
            self._heartbeat(still_to_send=later)
            p = later.pop(0)
            self._wait_for(p, source="waiting")
            if fragments[p].steps and not fragments[p].in_flight:
                self._send(p)
        wait(self._encoding)
        self._heartbeat(last_sent=True)
        for p in range(self.P):
            self._wait_for(p, source="waiting")
        self._drain_acks()
        self._heartbeat(done=True)
        linger_until = time.monotonic() + self.s.linger_s
        while time.monotonic() < linger_until and not self.stop_requested.is_set():
            self._apply_arrivals(timeout=0.2)
            self._heartbeat(done=True)
        self._apply_arrivals(timeout=0.5)
        # Training is over: nothing local is left to lose, so take the newest global values.
        for p, f in enumerate(self.outer.fragments):
            f.sent_theta = None  # overwrite: the learner ends on the global model itself
            if f.latest is not None and f.latest_version > f.version:
                self._adopt(p, f.latest, f.latest_version)
        self._evaluate()
        self._heartbeat(done=True)

    def summary(self) -> dict[str, Any]:
        synced = not self.s.standalone
        checksums = (
            [
                codecs.checksum(self.layout.gather(p, self._host_leaves(p)).tobytes())
                for p in range(self.P)
            ]
            if synced
            else []
        )
        wall = time.time() - self.timeline.started
        if synced:
            self._record("finished", checksums=checksums)
        return {
            "learner": self.s.id,
            "incarnation": self.incarnation,
            "steps": self.step,
            "tokens": self.tokens,
            "parameters": sum(s.size for s in self.specs),
            "wall_seconds": round(wall, 3),
            "started_at": self.timeline.started,
            "step_time_ema_s": self.ema_step_s,
            "loss": {
                "initial": self.timeline.losses[0][3] if self.timeline.losses else None,
                "final": self.loss,
            },
            "eval_loss": self.eval_loss,
            "losses": self.timeline.losses,
            "evals": self.timeline.evals,
            "badput_seconds": self.timeline.badput,
            "versions": [f.version for f in self.outer.fragments] if synced else [],
            "checksums": checksums,
            "bytes": {"up": self.client.stats.bytes_up, "down": self.client.stats.bytes_down},
            "reconnects": self.client.stats.reconnects,
            "data_position": self.w.batches.position,
        }

    # --- the slot's local checkpoint: what a restart goes on from ---------------------------
    def _checkpoints(self) -> ckpt.Slots:
        if self._slots is None:
            assert self.s.state_dir is not None
            self._slots = ckpt.Slots(self.s.state_dir / f"{self.s.id}.checkpoint")
        return self._slots

    def _checkpoint_key(self) -> dict[str, Any]:
        return {"job": self.s.job, "learner": self.s.id, "fragments": self.P, "inner_steps": self.H}

    def _checkpoint(self) -> None:
        """Take the state between two steps without waiting for it: a device-side copy
        (the next step donates the parameters' and optimizer state's buffers) whose copies
        to the host start now and run beside the next steps. The encoder thread waits for
        them, adds what it owns (residuals, the fragment each update took) after the sends
        queued before, and writes the file."""
        arrays: dict[str, np.ndarray] = {}
        fragments = self.outer.fragments
        records = [ckpt.fragment_record(p, f, arrays) for p, f in enumerate(fragments)]
        meta = {
            **self._checkpoint_key(),
            "step": self.step,
            "tokens": self.tokens,
            "position": self.w.batches.position,
        }
        params, opt_state = _device_copy((dict(self.params), self.opt_state))
        for leaf in jax.tree.leaves((params, opt_state)):
            leaf.copy_to_host_async()
        slots = self._checkpoints()

        def finish_and_write() -> tuple[int, int, float]:
            host_params, host_opt = jax.device_get((params, jax.tree.leaves(opt_state)))
            snap = ckpt.Snapshot(
                meta=meta,
                params={k: np.asarray(v) for k, v in host_params.items()},
                opt_leaves=[np.asarray(x) for x in host_opt],
                fragments=records,
                arrays=arrays,
            )
            for p, f in enumerate(fragments):
                in_flight = records[p]["awaiting_above"] is not None
                ckpt.encoder_arrays(p, f, in_flight, snap.arrays)
            slots.write(snap)
            return -1, -1, 0.0  # not an update: nothing to acknowledge

        self._writing = self._encoder.submit(finish_and_write)
        self._encoding.append(self._writing)

    def _restore(self) -> bool:
        """Go on from this slot's local checkpoint, if there is one for this job and model."""
        if self.s.state_dir is None or not self.s.checkpoint_every:
            return False
        loaded = self._checkpoints().read()
        if loaded is None:
            return False
        why = ckpt.matches(loaded, self._checkpoint_key(), list(self.params))
        if why is not None:
            log.warning("checkpoint_ignored", learner=self.s.id, reason=why)
            return False
        current = [(f.version, f.base) for f in self.outer.fragments]
        flat = dict(loaded.params)
        for p, (f, record) in enumerate(zip(self.outer.fragments, loaded.fragments, strict=True)):
            ckpt.restore_fragment(p, f, record, loaded.arrays)
            version, value = current[p]
            theta = f.carry_onto(self.layout.gather(p, flat), value, version)
            flat.update(self.layout.scatter(p, theta))
        self.params = jax.device_put({k: jnp.asarray(v) for k, v in flat.items()}, self.replicated)
        structure = jax.tree.structure(jax.eval_shape(self.tx.init, self.params))
        self.opt_state = jax.device_put(
            jax.tree.unflatten(structure, [jnp.asarray(x) for x in loaded.opt_leaves]),
            self.replicated,
        )
        self.step, self.tokens = int(loaded.meta["step"]), int(loaded.meta["tokens"])
        self.w.batches.position = int(loaded.meta["position"])
        log.info(
            "restored",
            learner=self.s.id,
            step=self.step,
            versions=[f.version for f in self.outer.fragments],
        )
        return True

    # --- where a learner slot stands: survives restarts ------------------------------------
    def _position_file(self) -> Path | None:
        return None if self.s.state_dir is None else self.s.state_dir / f"{self.s.id}.position.json"

    def _load_position(self) -> None:
        """A new incarnation of this slot goes on from where the last one stopped: the same
        step count (toward --steps) and the same place in its data shard."""
        path = self._position_file()
        if path is None or not path.exists():
            return
        saved = json.loads(path.read_text())
        self.w.batches.position = int(saved["position"])
        self.step, self.tokens = int(saved["step"]), int(saved["tokens"])
        log.info("resumed", learner=self.s.id, step=self.step, position=self.w.batches.position)

    def _save_position(self) -> None:
        path = self._position_file()
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        state = {"position": self.w.batches.position, "step": self.step, "tokens": self.tokens}
        tmp.write_text(json.dumps(state))
        tmp.replace(path)

    def close(self) -> None:
        self._encoder.shutdown(wait=True)
        self._save_position()
        self.client.close()
        self.tape.close()


@jax.jit
def _device_copy(tree: Any) -> Any:
    """Fresh device buffers holding the same values (never donated, so a background
    thread may read them while the next steps run)."""
    return jax.tree.map(jnp.copy, tree)


def install_stop_handler(learner: Learner) -> None:
    def handler(signum: int, _: Any) -> None:
        log.info("stop_requested", signal=signal.Signals(signum).name)
        learner.stop_requested.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def write_report(path: Path, summary: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary))
    tmp.replace(path)
