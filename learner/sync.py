"""The sync engine: what turns a JAX training loop into a learner of a job.

Any loop can use it: the built-in one (`learner.loop`) or a user's own, with their model,
their optax optimizer and their data. The loop owns its parameters and calls the engine
between two steps; the engine owns everything about the job (fragments, error feedback,
sends, acknowledgements, adoption of new global values, the final sync) and hands the
parameters back, with any newly adopted fragment written into them:

    engine = SyncEngine(settings, shapes, tokens_per_step=batch * context)
    params = engine.join(initial_params)            # the job's current global model
    for step in range(1, steps + 1):
        params, opt_state, loss = train_step(params, opt_state, next(batches))
        params = engine.after_step(step, params, loss=float(loss))
        if engine.job_finished():
            break
    params = engine.finish(params)                  # final sync: ends on the global model
    engine.done()
    engine.close()

Parameters are any pytree of float32 arrays with the structure of `shapes`; leaves are named
by their paths (`blocks/3/attn/qkv`), which is what the fragment layout and the wire see.
`after_step` never waits on the network in decoupled mode: an update's device-side copy is
taken at once and the encoder thread encodes and queues it: int8 and int4 on the device
itself (learner/device_codec.py), so only the encoded bytes cross to the host, other codecs
after copying it to the host. In sync mode it waits at each fragment's sync until that
fragment is merged (classic DiLoCo).

Threads: the caller's thread owns the fragments' bookkeeping and the parameters it passes
in; the encoder thread (one, so each fragment's error feedback stays in order) owns the
residuals and the fragment each in-flight update took, and hands a checkpoint references to
them in order with the sends queued before it; the checkpoint thread copies them and
writes the file; the stager thread places each arriving global value on the device. With
device encoding, every fragment's encoder is compiled when the learner joins.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import structlog

from learner import checkpoint as ckpt
from learner import device_codec
from learner.client import GlobalFragment, SynchronizerClient
from learner.outer import OuterState, due_fragments, sync_round
from learner.settings import LearnerSettings
from learner.workload import FlatParams, Named
from services import codec as codecs
from services import telemetry as tm
from services import tls
from services.config import INIT_CLAIM_S
from services.gen.atoll.v1 import session_pb2
from services.layout import FragmentLayout, LeafSpec, fragment_layout
from services.tape import Tape

log = structlog.get_logger("atoll.learner")
FINAL_SYNC_TIMEOUT_S = 120.0
INIT_POLL_S = 0.2  # how often a learner waiting for the job's initial parameters asks
EMA_DECAY = 0.9


@dataclass
class Restored:
    """What a slot's local checkpoint gave back: parameters moved onto the job's current
    values, the optimizer state's leaves, and the loop's place (step, tokens, position)."""

    params: Any
    opt_leaves: list[np.ndarray]
    meta: dict[str, Any]


class SyncEngine:
    """Joins a job, sends each fragment's outer gradient when it is due, adopts the replies.

    `settings` gives the job (`synchronizer`, `job`, `id`, `token`, `heartbeat_s`,
    `linger_s`, `tape`, `state_dir`); `shapes` is a pytree of arrays or
    `jax.ShapeDtypeStruct`s with the parameters' structure.
    """

    def __init__(
        self,
        settings: LearnerSettings,
        shapes: Any,
        *,
        tokens_per_step: int,
        tape: Tape | None = None,
        stop_requested: threading.Event | None = None,
    ) -> None:
        self.settings = settings
        self.named = Named.of(shapes)
        self.specs = [
            LeafSpec(n, tuple(int(d) for d in v.shape), "float32")
            for n, v in self.named.flatten(shapes).items()
        ]
        self.tokens_per_step = tokens_per_step
        self.incarnation = uuid.uuid4().hex
        # The loop's log lines name the slot, this incarnation and the job (bound once).
        structlog.contextvars.bind_contextvars(
            learner=settings.id, incarnation=self.incarnation, job=settings.job
        )
        self.tape = tape if tape is not None else Tape(settings.tape, settings.id)
        self.stop_requested = stop_requested or threading.Event()
        self.badput: dict[str, float] = dict.fromkeys(tm.BADPUT_SOURCES, 0.0)
        # What the heartbeats report: the loop tells (`after_step`'s keywords, `done`).
        self.step = 0
        self.tokens = 0
        # Tokens this incarnation began from (a restored slot's count): its tokens/s are its
        # own, since its own start, not the slot's total over this process's age.
        self._tokens_at_start = 0
        self.loss = math.nan
        self.eval_loss = math.nan
        self.ema_step_s = 0.0
        self._started = time.time()
        self._last_call = time.monotonic()
        self._last_heartbeat = 0.0
        self._reconnects_seen = 0
        self.pending_acks: dict[int, tuple[int, float]] = {}  # seq -> (fragment, compute s)
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atoll-encode")
        self._encoding: list[Future[tuple[int, int, float]]] = []
        # Global values that arrived, each with its leaves already on the device when the
        # loop will rebase onto them there (placed by the stager thread, off the loop).
        self._arrivals: queue.Queue[tuple[GlobalFragment, list[jax.Array] | None]] = queue.Queue()
        self._closing = threading.Event()
        self._stager: threading.Thread | None = None
        # Checkpoints are written by a thread of their own: a large one takes seconds.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atoll-checkpoint")
        self._writing: Future[None] | None = None  # the last checkpoint
        self.checkpoint_write_s = 0.0  # how long the last checkpoint took to write
        self._slots: ckpt.Slots | None = None
        self._refetch: set[int] = set()
        self._sent: dict[int, dict[str, jax.Array]] = {}  # in flight: the leaves as sent
        # With a codec encoded on the device (int8, int4): each fragment's anchor there too,
        # in layout order, so an update's outer gradient never crosses as float32.
        self._anchors: dict[int, list[jax.Array]] | None = None
        self._flat: FlatParams = {}  # the parameters during a call, as named leaves
        tm.LEARNER_PARAMETERS.set(sum(s.size for s in self.specs))
        self.client = SynchronizerClient(
            [a for addr in settings.synchronizer for a in addr.split(",") if a],
            job=settings.job,
            learner_id=settings.id,
            incarnation=self.incarnation,
            params=self.specs,
            token=settings.token,
            credentials=tls.learner_credentials(
                settings.insecure, settings.tls_ca, settings.tls_cert, settings.tls_key
            ),
            max_backoff_s=settings.max_backoff_s,
            give_up_s=settings.give_up_s,
            routes=parse_routes(settings.route),
            tls_server_name=settings.tls_server_name,
        )

    # --- joining --------------------------------------------------------------------------
    def join(self, initial: Any | Callable[[], Any], sharding: Any = None) -> Any:
        """Join the job and return its current global parameters, placed with `sharding`
        (one for every leaf, or a pytree of them; default: JAX's default device).
        `initial`: this learner's initial parameters, or a function making them (called
        only if the job still needs or holds them)."""
        welcome = self.client.connect(self.stop_requested)
        cfg = welcome.config
        self.mode, self.alpha = cfg.mode, cfg.merge_alpha
        self.fragments, self.inner_steps = cfg.fragments, cfg.inner_steps
        self.codec = codecs.by_wire(cfg.codec)
        self.block_size = cfg.block_size
        self.layout: FragmentLayout = fragment_layout(self.specs, self.fragments)
        # Fragments still at the value this learner initialized (same model and seed) are
        # not sent again: only their checksums travel. Once the job has moved on, this
        # learner's initial values can match nothing: they are not even made.
        mine: dict[int, np.ndarray] = {}
        if not welcome.initialized or not any(welcome.versions):
            made = self.named.flatten(initial() if callable(initial) else initial).items()
            flat = {k: np.asarray(v, np.float32) for k, v in made}
            mine = {p: self.layout.gather(p, flat) for p in range(self.fragments)}
        fetched: list[GlobalFragment] | None = None
        if not welcome.initialized and not welcome.initializer:
            fetched = self._await_initial(mine)  # another learner is sending them
        if not welcome.initialized and fetched is None:
            for p in range(self.fragments):
                self.client.send_initial(p, mine[p])
            deadline = time.monotonic() + 60
            while self.client.unacked() and time.monotonic() < deadline:
                self.client.check()
                time.sleep(0.05)
        if fetched is None:
            fetched = self.client.fetch_state(held=mine)
        globals_ = sorted(fetched, key=lambda g: g.fragment)
        if len(globals_) != self.fragments:
            raise RuntimeError(
                f"fetched {len(globals_)} of {self.fragments} global fragments; retry"
            )
        self.outer = OuterState.start(
            [(g.version, g.values) for g in globals_],
            self.codec,
            self.block_size,
            keep_progress=cfg.keep_overlap_progress,
            tensor_sizes=[tuple(leaf.size for leaf in f.leaves) for f in self.layout.fragments],
            feedback=(
                device_codec.DeviceFeedback
                if device_codec.supports(self.codec)
                else codecs.ErrorFeedback
            ),
        )
        values: dict[str, np.ndarray] = {}
        for g in globals_:
            values.update(self.layout.scatter(g.fragment, g.values))
        params = jax.device_put(self.named.unflatten(values), sharding)  # type: ignore[arg-type]
        placed = self.named.flatten(params)
        self._shardings = {n: leaf.sharding for n, leaf in placed.items()}
        if device_codec.supports(self.codec):
            self._anchors = {}
            for p, f in enumerate(self.outer.fragments):
                # Copies (the loop may donate the parameters); the send's copy, the rebase
                # and the encoder are compiled for them before the first sync.
                self._set_anchor(p, {n: jnp.copy(placed[n]) for n in self._names(p)})
                leaves = self._anchors[p]
                _rebase(leaves, leaves, _device_copy(leaves))
                if isinstance(f.feedback, device_codec.DeviceFeedback):
                    self._encoder.submit(f.feedback.warm, leaves)
        if self._stager is None:  # one, so arrivals keep their order
            self._stager = threading.Thread(target=self._stage, name="atoll-stage", daemon=True)
            self._stager.start()
        tm.REJOINS.inc()
        log.info(
            "joined",
            learner=self.settings.id,
            incarnation=self.incarnation,
            mode=self.mode,
            fragments=self.fragments,
            inner_steps=self.inner_steps,
            codec=self.codec.name,
            encodes_on="host" if self._anchors is None else "device",
            versions=[g.version for g in globals_],
            initialized_job=not welcome.initialized,
        )
        return params

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
        log.warning("initial_parameters_late", learner=self.settings.id)
        return None

    def joined(self, restored: bool, step: int = 0, tokens: int = 0) -> None:
        """Record on the tape where this incarnation starts: after any restore, at the
        loop's step and token count (a restarted slot goes on from them)."""
        self.step, self.tokens = step, tokens
        self._tokens_at_start = tokens
        self._last_call = time.monotonic()
        self.record("joined", restored=restored)

    # --- between two steps ----------------------------------------------------------------
    def count_compute(self, seconds: float) -> None:
        """Compute time of a step already counted by `after_step` without it (a loop that
        learns a step's time one step late hands over the last one here)."""
        for f in self.outer.fragments:
            f.compute_seconds += seconds

    def after_step(
        self,
        step: int,
        params: Any,
        *,
        tokens: int | None = None,
        seconds: float | None = None,
        loss: float | None = None,
    ) -> Any:
        """The hook a loop calls after each inner step: adopt replies that arrived, send
        the fragments that are due (sync mode: wait for their merge), heartbeat every
        `heartbeat_s`. Returns the
        parameters, with adopted fragments written in. `tokens` (default: tokens_per_step)
        and `seconds` (default: the time since the last call) are the step's, for the
        goodput accounting; `loss` goes into heartbeats."""
        now = time.monotonic()
        seconds = now - self._last_call if seconds is None else seconds
        tokens = self.tokens_per_step if tokens is None else tokens
        self.step, self.tokens = step, self.tokens + tokens
        if loss is not None:
            self.loss = loss
        self.ema_step_s = (
            seconds
            if not self.ema_step_s
            else (EMA_DECAY * self.ema_step_s + (1 - EMA_DECAY) * seconds)
        )
        self._flat = self.named.flatten(params)
        try:
            for f in self.outer.fragments:
                f.count(tokens, seconds)
            self._apply_arrivals()
            self._drain_acks()
            for p in due_fragments(step, self.fragments, self.inner_steps):
                f = self.outer.fragments[p]
                if self.mode == "sync" and f.version >= sync_round(
                    step, p, self.fragments, self.inner_steps
                ):
                    # An earlier incarnation of this slot already sent this round's update
                    # (it was restored to a step before that send): sending again would wait
                    # for a round the others reach only a full cycle later, while they wait
                    # for it.
                    continue
                f.due = True
            for p, f in enumerate(self.outer.fragments):
                if f.due and not f.in_flight and f.steps:
                    self._send(p)
                    if self.mode == "sync":
                        self._wait_for(p, source="waiting")
            if time.monotonic() - self._last_heartbeat >= self.settings.heartbeat_s:
                self.heartbeat()
            return self.named.unflatten(self._flat)
        finally:
            self._flat = {}
            self._last_call = time.monotonic()

    def job_finished(self) -> bool:
        """Whether the job's budget of steps is spent (then the loop stops and finishes).
        Raises if the session to the synchronizers failed for good."""
        self.client.check()
        return self.client.job_finished

    def global_params(self, sharding: Any = None) -> Any:
        """The global model as this learner last saw it (what an eval should measure),
        placed with `sharding` (as `join`'s)."""
        flat: dict[str, np.ndarray] = {}
        for p, f in enumerate(self.outer.fragments):
            newer = f.latest is not None and f.latest_version > f.version
            flat.update(self.layout.scatter(p, f.latest if newer else f.base))  # type: ignore[arg-type]
        return jax.device_put(self.named.unflatten(flat), sharding)  # type: ignore[arg-type]

    def _names(self, p: int) -> list[str]:
        return [leaf.name for leaf in self.layout.fragments[p].leaves]

    def _set_anchor(self, p: int, leaves: dict[str, jax.Array]) -> None:
        """Fragment p's anchor on the device (buffers the loop never donates), when its
        updates are encoded there."""
        if self._anchors is not None:
            self._anchors[p] = [leaves[n] for n in self._names(p)]

    def _send(self, p: int) -> None:
        """Start fragment p's update; the encoder thread finishes and queues it."""
        f = self.outer.fragments[p]
        send = f.begin_send()
        names = self._names(p)
        # A device-side copy: the loop's step may donate the parameters' buffers. It also
        # stays on the device until the reply comes: the rebase is computed there.
        snapshot: list[jax.Array] = _device_copy([self._flat[n] for n in names])
        self._sent[p] = dict(zip(names, snapshot, strict=True))
        anchor = None if self._anchors is None else self._anchors[p]

        def encode() -> list[codecs.Segment]:
            feedback = f.feedback
            if anchor is not None and isinstance(feedback, device_codec.DeviceFeedback):
                # Encoded where it was computed: only the bytes and the norms cross over.
                f.sent_theta = _LeftOnDevice(self.layout, p, names, snapshot)
                return feedback.encode_update(anchor, snapshot)
            host = dict(zip(names, jax.device_get(snapshot), strict=True))
            return f.encode(send, self.layout.gather(p, host))

        def encode_and_queue() -> tuple[int, int, float]:
            seq = self.client.send_update(
                fragment=p,
                payload=encode(),
                tensor_norms=f.feedback.norms,  # radial merging reads them first
                codec=self.codec.wire,
                block_size=self.block_size,
                num_elements=self.layout.fragments[p].num_elements,
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
        return dict(zip(names, jax.device_get([self._flat[n] for n in names]), strict=True))

    def _apply_arrivals(self, timeout: float = 0.0) -> bool:
        """Apply global values that arrived; return True if any reply was adopted."""
        adopted = False
        while True:
            try:
                g, placed = self._arrivals.get(timeout=timeout)
            except queue.Empty:
                return adopted
            timeout = 0.0
            f = self.outer.fragments[g.fragment]
            if f.receive(g.values, g.version):
                self._adopt(g.fragment, g.values, g.version, placed)
                adopted = True

    def _stage(self) -> None:
        """The stager thread: each global value that arrives, with its leaves copied onto
        the device when it answers an update in flight (the copies are the host's work; the
        loop only dispatches the rebase), handed to the loop in arrival order."""
        while not self._closing.is_set():
            try:
                g = self.client.fragments.get(timeout=0.2)
            except queue.Empty:
                continue
            placed = None
            f = self.outer.fragments[g.fragment]
            # Only a value the loop will adopt as the reply it waits for is placed (a stale
            # read of the loop's state only leaves the placing to `_adopt`).
            awaiting = f.awaiting_above
            if f.keep_progress and awaiting is not None and g.version > awaiting:
                try:
                    placed = self._place(g.fragment, g.values)
                except Exception as err:  # placed again by the loop, which raises it there
                    log.warning("staging_failed", fragment=g.fragment, error=repr(err))
            self._arrivals.put((g, placed))

    def _place(self, p: int, value: np.ndarray) -> list[jax.Array]:
        """Fragment p's `value` as its leaves on the device, in layout order."""
        names = self._names(p)
        host = self.layout.scatter(p, value)
        placed: list[jax.Array] = jax.device_put(
            [host[n] for n in names], [self._shardings[n] for n in names]
        )
        return placed

    def _adopt(
        self, p: int, value: np.ndarray, version: int, placed: list[jax.Array] | None = None
    ) -> None:
        """Adopt fragment p's new global value (`placed`: its leaves on the device)."""
        f = self.outer.fragments[p]
        sent = self._sent.pop(p, None)
        if f.keep_progress and f.sent_theta is not None and sent is not None:
            # theta <- Theta + (theta - theta_sent), on the device: nothing waits for the
            # step in flight, and only the new global value crosses to the device.
            placed = self._place(p, value) if placed is None else placed
            names = self._names(p)
            incoming = dict(zip(names, placed, strict=True))
            rebased = _rebase(placed, [self._flat[n] for n in names], [sent[n] for n in names])
            self._flat.update(zip(names, rebased, strict=True))
            f.adopt(value, version)
            self._set_anchor(p, incoming)
            return
        needs_local = self.alpha or (f.keep_progress and f.sent_theta is not None)
        theta = self.layout.gather(p, self._host_leaves(p)) if needs_local else value
        merged = f.local_value(theta, value, self.alpha)
        f.adopt(value, version)
        for name, leaf in self.layout.scatter(p, merged).items():
            self._flat[name] = jax.device_put(jnp.asarray(leaf), self._flat[name].sharding)
        if self._anchors is not None:  # the global value, which `merged` may not be
            self._set_anchor(
                p,
                {
                    name: jax.device_put(jnp.asarray(leaf), self._flat[name].sharding)
                    for name, leaf in self.layout.scatter(p, value).items()
                },
            )

    def _wait_for(self, p: int, source: str, timeout: float = FINAL_SYNC_TIMEOUT_S) -> None:
        """Block until fragment p's reply is adopted (sync mode, final sync)."""
        f = self.outer.fragments[p]
        self._wait_while(lambda: f.in_flight, source, timeout)

    def _wait_for_final_acks(self) -> None:
        """Block until every update sent has its final ack (merged, a duplicate, or refused).
        One an owner received but had not merged when it died is still this learner's to
        send again: saying `done` before it merges would let the job end first, and it
        would merge after the learners had taken what they took as the final model."""
        self._drain_acks()
        self._wait_while(lambda: bool(self.pending_acks or self._encoding), "waiting")
        if self.pending_acks:
            log.warning("final_acks_missing", updates=sorted(self.pending_acks))

    def _wait_while(
        self, pending: Callable[[], bool], source: str, timeout: float = FINAL_SYNC_TIMEOUT_S
    ) -> None:
        """Take acks and global values while `pending()` holds, for at most `timeout` (a
        stop request ends a final wait); the time waited is badput of `source`."""
        t0 = time.monotonic()
        while pending() and time.monotonic() - t0 < timeout:
            self.client.check()
            self._drain_acks()
            if self._apply_arrivals(timeout=0.05):
                continue
            if self.stop_requested.is_set() and source == "waiting":
                break
        self.add_badput(source, time.monotonic() - t0)

    def _drain_acks(self) -> None:
        still = []
        for job in self._encoding:
            if job.done():
                seq, p, compute = job.result()
                self.pending_acks[seq] = (p, compute)
            else:
                still.append(job)
        self._encoding = still
        for seq in list(self.pending_acks):
            ack = self._final_ack(seq)
            if ack is None:
                continue
            p, compute = self.pending_acks.pop(seq)
            status = session_pb2.AckStatus.Name(ack.status).removeprefix("ACK_STATUS_").lower()
            self.tape.write("acked", uid=self._uid(seq), fragment=p, status=status)
            if ack.status in (session_pb2.ACK_STATUS_COMMITTED, session_pb2.ACK_STATUS_DUPLICATE):
                tm.GOODPUT.credit(compute / self.fragments)
                continue
            log.warning("update_refused", update=self._uid(seq), fragment=p, reason=ack.reason)
            self.add_badput("lost", compute / self.fragments)
            self._refetch.add(p)  # continue from the current global value
        self._fetch_refused()

    def _final_ack(self, seq: int) -> session_pb2.Ack | None:
        """An update's final ack, once it has one."""
        return self.client.stats.acks.get(seq)

    def _fetch_refused(self) -> None:
        """Adopt the current global value of fragments whose update was refused; if no
        synchronizer answers now, the next step tries again (the session reconnects)."""
        if not self._refetch:
            return
        try:
            fetched = self.client.fetch_state(sorted(self._refetch), retry=False)
        except (grpc.RpcError, ValueError) as err:
            log.info("refetch_deferred", fragments=sorted(self._refetch), error=str(err))
            return
        for g in fetched:
            self.outer.fragments[g.fragment].receive(g.values, g.version)
            self._adopt(g.fragment, g.values, g.version)
            self._refetch.discard(g.fragment)

    def add_badput(self, source: str, seconds: float) -> None:
        """Learner seconds that did not become merged progress, by source."""
        self.badput[source] += seconds
        tm.BADPUT_SECONDS.labels(source=source).inc(seconds)

    def record(self, kind: str, **fields: Any) -> None:
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
        return f"{self.settings.id}/{self.incarnation}/{seq}"

    def heartbeat(
        self, done: bool = False, last_sent: bool = False, still_to_send: list[int] | None = None
    ) -> None:
        """Tell the synchronizer where this learner stands (step, speed, losses)."""
        self._last_heartbeat = time.monotonic()
        if self.client.stats.reconnects != self._reconnects_seen:
            self._reconnects_seen = self.client.stats.reconnects
            self.tape.write("reconnected", reconnects=self._reconnects_seen)
        elapsed = max(1e-9, time.time() - self._started)
        self.client.heartbeat(
            step=self.step,
            step_time_ema_s=self.ema_step_s,
            tokens_per_s=(self.tokens - self._tokens_at_start) / elapsed,
            loss=self.loss,
            eval_loss=self.eval_loss,
            done=done,
            last_sent=last_sent,  # the synchronizer takes `done` as saying it too
            still_to_send=still_to_send,
        )

    # --- the end --------------------------------------------------------------------------
    def finish(self, params: Any) -> Any:
        """Send what every fragment learned since its anchor and adopt the replies; return
        the parameters, now the newest global model this learner saw.

        Fragments with nothing in flight go at once. One whose update is still in flight
        sends its later steps once the reply is in. After each send the learner says, in a
        heartbeat behind the updates on the stream, which fragments it will still send: the
        synchronizer merges a round as soon as no live learner can add to it, instead of
        waiting out a quorum or a grace window that nothing more will fill. Call `done`
        after it (once the final eval, if any, is known).
        """
        self._flat = self.named.flatten(params)
        try:
            fragments = self.outer.fragments
            for p, f in enumerate(fragments):
                if f.steps and not f.in_flight:
                    self._send(p)
            later = [p for p, f in enumerate(fragments) if f.in_flight and f.steps]
            while later:
                wait(self._encoding)
                self.heartbeat(still_to_send=later)
                p = later.pop(0)
                self._wait_for(p, source="waiting")
                if fragments[p].steps and not fragments[p].in_flight:
                    self._send(p)
            wait(self._encoding)
            self.heartbeat(last_sent=True)
            for p in range(self.fragments):
                self._wait_for(p, source="waiting")
            self._wait_for_final_acks()
            self.heartbeat(done=True)
            tm.GOODPUT.end()
            self._linger()
            self._apply_arrivals(timeout=0.5)
            # Training is over: nothing local is left to lose: take the newest global values.
            for p, f in enumerate(self.outer.fragments):
                f.sent_theta = None  # overwrite: the learner ends on the global model itself
                if f.latest is not None and f.latest_version > f.version:
                    self._adopt(p, f.latest, f.latest_version)
            return self.named.unflatten(self._flat)
        finally:
            self._flat = {}

    def _linger(self) -> None:
        """Keep taking new global values for --linger-s (or until stopped)."""
        linger_until = time.monotonic() + self.settings.linger_s
        while time.monotonic() < linger_until and not self.stop_requested.is_set():
            self._apply_arrivals(timeout=0.2)
            self.heartbeat(done=True)

    def done(self, eval_loss: float | None = None) -> None:
        """The last heartbeat: this learner is done (with its final eval loss, if any)."""
        if eval_loss is not None:
            self.eval_loss = eval_loss
        self.heartbeat(done=True)

    def summary(self, params: Any) -> dict[str, Any]:
        """The fragments' versions and checksums of `params`, and the bytes moved; records
        the end on the tape."""
        self._flat = self.named.flatten(params)
        try:
            checksums = [
                codecs.checksum(self.layout.gather(p, self._host_leaves(p)).tobytes())
                for p in range(self.fragments)
            ]
        finally:
            self._flat = {}
        self.record("finished", checksums=checksums)
        return {
            "incarnation": self.incarnation,
            "versions": [f.version for f in self.outer.fragments],
            "checksums": checksums,
            "bytes": {"up": self.client.stats.bytes_up, "down": self.client.stats.bytes_down},
            "reconnects": self.client.stats.reconnects,
        }

    def close(self) -> None:
        """Wait for the encoder and checkpoint threads and close the session."""
        self._closing.set()
        if self._stager is not None:  # never left inside the runtime as the process exits
            self._stager.join()
        self._encoder.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        failed = None if self._writing is None else self._writing.exception()
        if failed is not None:
            log.error("checkpoint_failed", error=repr(failed))
        self.client.close()

    # --- the slot's local checkpoint: what a restart goes on from ---------------------------
    def _checkpoints(self) -> ckpt.Slots:
        if self._slots is None:
            state_dir = self.settings.state_dir
            assert state_dir is not None
            self._slots = ckpt.Slots(Path(state_dir) / f"{self.settings.id}.checkpoint")
        return self._slots

    def _checkpoint_key(self) -> dict[str, Any]:
        return {
            "job": self.settings.job,
            "learner": self.settings.id,
            "fragments": self.fragments,
            "inner_steps": self.inner_steps,
        }

    def checkpoint_ready(self) -> bool:
        """Whether the last checkpoint is written (the next is never queued behind it).
        Raises what failed its writing (a full disk, say): a learner whose checkpoints
        cannot be written stops, rather than train on with nothing to restart from."""
        if self._writing is None:
            return True
        if not self._writing.done():
            return False
        self._writing.result()
        return True

    def checkpoint(self, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
        """Write a checkpoint of `params`, `opt_state` and this engine's bookkeeping to
        `--state-dir`, without waiting for it: a device-side copy (the next step may donate
        the buffers) whose copies to the host start now and run beside the next steps. The
        encoder thread takes what it owns (residuals, the fragment each update took) after
        the sends queued before; the writer thread copies those, waits for the rest and
        writes the file, so a large checkpoint never holds up an update behind it. `meta`:
        the loop's place (step, tokens, data position)."""
        arrays: dict[str, np.ndarray] = {}
        fragments = self.outer.fragments
        records = [ckpt.fragment_record(p, f, arrays) for p, f in enumerate(fragments)]
        meta = {**self._checkpoint_key(), **meta}
        flat, opt = _device_copy((self.named.flatten(params), opt_state))
        for leaf in jax.tree.leaves((flat, opt)):
            leaf.copy_to_host_async()
        slots = self._checkpoints()
        in_flight = [record["awaiting_above"] is not None for record in records]
        held = self._encoder.submit(
            lambda: [ckpt.encoder_held(f, i) for f, i in zip(fragments, in_flight, strict=True)]
        )

        def write() -> None:
            host_params, host_opt = jax.device_get((flat, jax.tree.leaves(opt)))
            # Timed from here: waiting for the copies is waiting for the step queued before
            # them (the loop runs steps ahead), which is the loop's time, not the write's.
            t0 = time.monotonic()
            snap = ckpt.Snapshot(
                meta=meta,
                params={k: np.asarray(v) for k, v in host_params.items()},
                opt_leaves=[np.asarray(x) for x in host_opt],
                fragments=records,
                arrays=arrays,
            )
            for p, state in enumerate(held.result()):
                ckpt.encoder_arrays(p, state, snap.arrays)
            slots.write(snap)
            self.checkpoint_write_s = time.monotonic() - t0

        self._writing = self._writer.submit(write)

    def restore(self, params: Any) -> Restored | None:
        """This slot's local checkpoint, if there is one for this job and model, with every
        fragment moved onto the job's current value (`params`, as `join` returned them),
        keeping the progress made since its anchor."""
        if self.settings.state_dir is None:
            return None
        loaded = self._checkpoints().read()
        if loaded is None:
            return None
        current_flat = self.named.flatten(params)
        why = ckpt.matches(loaded, self._checkpoint_key(), list(current_flat))
        if why is not None:
            log.warning("checkpoint_ignored", learner=self.settings.id, reason=why)
            return None
        current = [(f.version, f.base) for f in self.outer.fragments]
        flat = dict(loaded.params)
        for p, (f, record) in enumerate(zip(self.outer.fragments, loaded.fragments, strict=True)):
            ckpt.restore_fragment(p, f, record, loaded.arrays)
            version, value = current[p]
            theta = f.carry_onto(self.layout.gather(p, flat), value, version)
            flat.update(self.layout.scatter(p, theta))
        placed = {
            k: jax.device_put(jnp.asarray(flat[k]), v.sharding) for k, v in current_flat.items()
        }
        self.step, self.tokens = int(loaded.meta["step"]), int(loaded.meta["tokens"])
        self._tokens_at_start = self.tokens
        log.info(
            "restored",
            learner=self.settings.id,
            step=self.step,
            versions=[f.version for f in self.outer.fragments],
        )
        return Restored(self.named.unflatten(placed), loaded.opt_leaves, loaded.meta)


class _LeftOnDevice:
    """A fragment's leaves as an update took them, left on the device; `np.asarray`
    gathers them on the host (a checkpoint taken while the update is in flight does)."""

    def __init__(
        self, layout: FragmentLayout, p: int, names: list[str], leaves: list[jax.Array]
    ) -> None:
        self.layout, self.p, self.names, self.leaves = layout, p, names, leaves

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        host = dict(zip(self.names, jax.device_get(self.leaves), strict=True))
        return np.asarray(self.layout.gather(self.p, host), dtype)


@jax.jit
def _device_copy(tree: Any) -> Any:
    """Fresh device buffers holding the same values (never donated, so a background
    thread may read them while the next steps run)."""
    return jax.tree.map(jnp.copy, tree)


@jax.jit
def _rebase(
    incoming: list[jax.Array], theta: list[jax.Array], sent: list[jax.Array]
) -> list[jax.Array]:
    """Each new global value plus the local progress since the update was taken (float32,
    as learner.outer.rebase computes it on the host): one dispatch for a fragment."""
    return [i + (t - s) for i, t, s in zip(incoming, theta, sent, strict=True)]


def parse_routes(items: list[str]) -> dict[str, str]:
    """`--route ADVERTISED=REACHABLE[,...]` as a mapping; a malformed one is refused."""
    routes = {}
    for item in (r for entry in items for r in entry.split(",") if r):
        advertised, sep, reachable = item.partition("=")
        if not sep or not advertised or not reachable:
            raise ValueError(f"--route {item!r} is not ADVERTISED=REACHABLE (HOST:PORT=HOST:PORT)")
        routes[advertised] = reachable
    return routes
