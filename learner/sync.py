"""The sync engine: what turns a JAX training loop into a learner of a job.

Any loop can use it: the built-in one (`learner.loop`) or a user's own, with their model,
their optax optimizer and their data. The loop owns its parameters and calls the engine's
hooks, each with what it knows; the engine owns everything about the job (fragments, sends,
acknowledgements, adoption of new global values, the final sync) and hands the parameters
back, with any newly adopted fragment written into them:

    engine = SyncEngine(settings, shapes, tokens_per_step=batch * context)
    params = engine.join(initial_params)            # the job's current global model
    for step in range(1, steps + 1):
        params, opt_state, loss = train_step(params, opt_state, next(batches))
        params = engine.after_step(step, params, loss=float(loss))
        if engine.job_finished():
            break
    params = engine.finish(params)                  # final sync: ends on the global model
    summary = engine.done(params)
    engine.close()

Parameters are any pytree of float32 arrays with the structure of `shapes`; leaves are named
by their paths (`blocks/3/attn/qkv`), which is what the fragment layout and the wire see.
`after_step` never waits on the network in decoupled mode: an update's values are copied
off the parameters at once and the encoder thread encodes and queues it. In sync mode it
waits at each fragment's sync until that fragment is merged (classic DiLoCo).

The engine decides; its fragment I/O (learner/fragment_io.py) moves values and news: whole
fragments for a learner of one process (the default), or this process's ranges for one
process of several. Threads: the caller's thread owns the fragments' bookkeeping and the
parameters it passes in; the encoder thread (one, so each fragment's error feedback stays in
order) encodes and queues each update; the fragment I/O's threads are its own.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import structlog

from learner.checkpointer import Checkpointer
from learner.client import SynchronizerClient
from learner.fragment_io import FragmentIO, Link
from learner.outer import due_fragments, sync_round
from learner.settings import LearnerSettings
from learner.whole_fragments import WholeFragments
from learner.workload import FlatParams, Named
from services import telemetry as tm
from services import tls
from services.gen.atoll.v1 import session_pb2
from services.layout import LeafSpec
from services.tape import Tape

log = structlog.get_logger("atoll.learner")
FINAL_SYNC_TIMEOUT_S = 120.0
EMA_DECAY = 0.9
WAIT_POLL_S = 0.05  # how long a wait takes news before it looks again


@dataclass
class Standing:
    """Where this learner stands, as its heartbeats report it."""

    step: int = 0
    tokens: int = 0
    # Tokens this incarnation began from (a restored slot's count): its tokens/s are its
    # own, since its own start, not the slot's total over this process's age.
    tokens_at_start: int = 0
    loss: float = math.nan
    eval_loss: float = math.nan
    ema_step_s: float = 0.0
    started: float = field(default_factory=time.time)

    def start(self, step: int, tokens: int) -> None:
        self.step, self.tokens, self.tokens_at_start = step, tokens, tokens

    def advance(self, step: int, tokens: int, seconds: float) -> None:
        """One step of `tokens` taken in `seconds`."""
        self.step, self.tokens = step, self.tokens + tokens
        self.ema_step_s = (
            seconds
            if not self.ema_step_s
            else (EMA_DECAY * self.ema_step_s + (1 - EMA_DECAY) * seconds)
        )

    def tokens_per_s(self) -> float:
        return (self.tokens - self.tokens_at_start) / max(1e-9, time.time() - self.started)


class SyncEngine:
    """Joins a job, sends each fragment's outer gradient when it is due, adopts the replies.

    `settings` gives the job (`synchronizer`, `job`, `id`, `token`, `heartbeat_s`,
    `linger_s`, `tape`, `state_dir`); `shapes` is a pytree of arrays or
    `jax.ShapeDtypeStruct`s with the parameters' structure. `fragment_io`: how fragments
    move (default: whole, for a learner of one process); `checkpoints`: the slot's local
    checkpoints, which the loop writes and a joining engine restores.
    """

    def __init__(
        self,
        settings: LearnerSettings,
        shapes: Any,
        *,
        tokens_per_step: int,
        fragment_io: FragmentIO | None = None,
        checkpoints: Checkpointer | None = None,
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
        self.io: FragmentIO = fragment_io or WholeFragments(checkpoints)
        self.incarnation = self.io.incarnation(uuid.uuid4().hex)
        # The loop's log lines name the slot, this incarnation and the job (bound once).
        structlog.contextvars.bind_contextvars(
            learner=settings.id, incarnation=self.incarnation, job=settings.job
        )
        self.checkpoints = checkpoints
        self.tape = tape if tape is not None else Tape(settings.tape, settings.id)
        self.stop_requested = stop_requested or threading.Event()
        self.badput: dict[str, float] = dict.fromkeys(tm.BADPUT_SOURCES, 0.0)
        self.standing = Standing()  # what the heartbeats report
        self._last_call = time.monotonic()
        self._last_heartbeat = 0.0
        self._reconnects_seen = 0
        self.pending_acks: dict[int, tuple[int, float]] = {}  # seq -> (fragment, compute s)
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atoll-encode")
        self._encoding: list[Future[tuple[int, int, float]]] = []
        self._refetch: set[int] = set()
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
            version_notices=self.io.version_notices,
            tls_server_name=settings.tls_server_name,
        )

    # --- the hooks a loop calls -----------------------------------------------------------
    def join(
        self,
        initial: Any | Callable[[], Any],
        sharding: Any = None,
        *,
        step: int = 0,
        tokens: int = 0,
    ) -> Any:
        """Join the job and return its current global parameters, placed with `sharding`
        (one for every leaf, or a pytree of them; default: JAX's default device).
        `initial`: this learner's initial parameters, or a function making them (called
        only if the job still needs or holds them). `step`, `tokens`: where the loop goes
        on from (a restarted slot's); a local checkpoint the engine restores overrides them
        (the loop finds it in `checkpoints.restored`)."""
        link = Link(
            self.settings, self.client, self.named, self.specs, self._encoder, self.stop_requested
        )
        joined = self.io.join(link, initial, sharding)
        self.job, self.outer = joined.config, joined.outer
        restored = None if self.checkpoints is None else self.checkpoints.restored
        if restored is not None:
            step, tokens = int(restored.meta["step"]), int(restored.meta["tokens"])
        self.standing.start(step, tokens)
        self._last_call = time.monotonic()
        tm.REJOINS.inc()
        self.record("joined", restored=restored is not None)
        return joined.params

    def after_step(
        self,
        step: int,
        params: Any,
        *,
        tokens: int | None = None,
        seconds: float | None = None,
        loss: float | None = None,
        eval_loss: float | None = None,
    ) -> Any:
        """The hook a loop calls after each inner step: adopt replies that arrived, send
        the fragments that are due (sync mode: wait for their merge), heartbeat every
        `heartbeat_s`. Returns the parameters, with adopted fragments written in. `tokens`
        (default: tokens_per_step) and `seconds` (default: the time since the last call)
        are the step's, for the goodput accounting; `loss` and `eval_loss` (the last eval
        of the global model) go into heartbeats."""
        now = time.monotonic()
        seconds = now - self._last_call if seconds is None else seconds
        tokens = self.tokens_per_step if tokens is None else tokens
        self.standing.advance(step, tokens, seconds)
        self._report(loss, eval_loss)
        self._flat = self.named.flatten(params)
        try:
            for f in self.outer.fragments:
                f.count(tokens, seconds)
            self.io.news(self._flat, wait=0.0, halt=False)
            self._drain_acks()
            fragments, inner_steps = self.job.fragments, self.job.inner_steps
            for p in due_fragments(step, fragments, inner_steps):
                f = self.outer.fragments[p]
                if self.job.mode == "sync" and f.version >= sync_round(
                    step, p, fragments, inner_steps
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
                    if self.job.mode == "sync":
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
        return self.io.job_finished()

    def global_params(self, sharding: Any = None) -> Any:
        """The global model as this learner last saw it (what an eval should measure),
        placed with `sharding` (as `join`'s)."""
        return self.io.global_params(sharding)

    def finish(
        self, params: Any, *, compute_seconds: float = 0.0, eval_loss: float | None = None
    ) -> Any:
        """Send what every fragment learned since its anchor and adopt the replies; return
        the parameters, now the newest global model this learner saw. `compute_seconds`:
        compute of steps already handed to `after_step` without it (a loop that learns a
        step's time steps late hands the last ones over here).

        Fragments with nothing in flight go at once. One whose update is still in flight
        sends its later steps once the reply is in. After each send the learner says, in a
        heartbeat behind the updates on the stream, which fragments it will still send: the
        synchronizer merges a round as soon as no live learner can add to it, instead of
        waiting out a quorum or a grace window that nothing more will fill. Call `done`
        after it (once the final eval, if any, is known).
        """
        self._report(None, eval_loss)
        self._flat = self.named.flatten(params)
        try:
            fragments = self.outer.fragments
            for f in fragments:
                f.compute_seconds += compute_seconds
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
            for p in range(self.job.fragments):
                self._wait_for(p, source="waiting")
            self._wait_for_final_acks()
            self.heartbeat(done=True)
            tm.GOODPUT.end()
            self._linger()
            self.io.news(self._flat, wait=0.5, halt=False)
            # Training is over: nothing local is left to lose: take the newest global values.
            for p, f in enumerate(fragments):
                f.sent_theta = None  # overwrite: the learner ends on the global model itself
                if f.latest is not None and f.latest_version > f.version:
                    self.io.adopt(self._flat, p, f.latest, f.latest_version)
            return self.named.unflatten(self._flat)
        finally:
            self._flat = {}

    def done(self, params: Any, eval_loss: float | None = None) -> dict[str, Any]:
        """The last heartbeat: this learner is done (with its final eval loss, if any).
        Returns its summary: the fragments' versions and checksums of `params`, the bytes
        moved, badput by source; records the end on the tape."""
        self._report(None, eval_loss)
        self.heartbeat(done=True)
        checksums = self.io.checksums(self.named.flatten(params))
        self.record("finished", checksums=checksums, **self.io.tape_fields)
        return {
            "incarnation": self.incarnation,
            "versions": [f.version for f in self.outer.fragments],
            "checksums": checksums,
            "bytes": {"up": self.client.stats.bytes_up, "down": self.client.stats.bytes_down},
            "reconnects": self.client.stats.reconnects,
            "badput": dict(self.badput),
            **self.io.report(),
        }

    def close(self) -> None:
        """Wait for the engine's threads and close the session."""
        self.io.close()
        self._encoder.shutdown(wait=True)
        if self.checkpoints is not None:
            self.checkpoints.close()
        self.client.close()

    # --- sending and settling ----------------------------------------------------------------
    def _report(self, loss: float | None, eval_loss: float | None) -> None:
        if loss is not None:
            self.standing.loss = loss
        if eval_loss is not None:
            self.standing.eval_loss = eval_loss

    def _send(self, p: int) -> None:
        """Start fragment p's update; the encoder thread finishes and queues it."""
        f = self.outer.fragments[p]
        send = f.begin_send()
        out = self.io.take(p, send, self._flat)

        def encode_and_queue() -> tuple[int, int, float]:
            payload = out.encode()
            seq = self.client.send_update(
                fragment=p,
                payload=payload,
                tensor_norms=f.feedback.norms,  # radial merging reads them first
                codec=self.job.codec,
                block_size=self.job.block_size,
                num_elements=out.num_elements,
                base_version=send.version,
                c_steps=send.steps,
                c_tokens=send.tokens,
                compute_seconds=send.compute_seconds,
                seq=out.seq,
                part=out.part,
                parts=out.parts,
            )
            self.tape.write(
                "sent",
                uid=self._uid(seq),
                fragment=p,
                base_version=send.version,
                steps=send.steps,
                compute_seconds=round(send.compute_seconds, 6),
                **self.io.tape_fields,
            )
            return seq, p, send.compute_seconds

        self._encoding.append(self._encoder.submit(encode_and_queue))

    def _drain_acks(self) -> None:
        still = []
        for job in self._encoding:
            if job.done():
                seq, p, compute = job.result()
                self.pending_acks[seq] = (p, compute)
                f = self.outer.fragments[p]
                if f.in_flight and f.sent_seq is None:
                    f.sent_seq = seq  # its ack names the version to adopt
            else:
                still.append(job)
        self._encoding = still
        share = self.job.fragments
        for seq in list(self.pending_acks):
            ack = self.io.final_ack(seq)
            if ack is None:
                continue
            p, compute = self.pending_acks.pop(seq)
            status = session_pb2.AckStatus.Name(ack.status).removeprefix("ACK_STATUS_").lower()
            self.tape.write("acked", uid=self._uid(seq), fragment=p, status=status)
            if ack.status in (session_pb2.ACK_STATUS_COMMITTED, session_pb2.ACK_STATUS_DUPLICATE):
                tm.GOODPUT.credit(compute / share)
                f = self.outer.fragments[p]
                if f.confirmed(seq, ack.version):  # the reply it held for this ack
                    assert f.latest is not None
                    self.io.adopt(self._flat, p, f.latest, f.latest_version)
                continue
            log.warning("update_refused", update=self._uid(seq), fragment=p, reason=ack.reason)
            self.add_badput("lost", compute / share)
            self._refetch.add(p)  # continue from the current global value
        if self._refetch:
            self._refetch = self.io.refetch(self._flat, self._refetch)

    # --- waiting --------------------------------------------------------------------------
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
        """Take acks and global values while `pending()` holds, until its timeout or a stop
        request ends a final wait (a learner of several processes: at the tick where its
        leader does); the time waited is badput of `source`."""
        t0 = time.monotonic()
        while pending():
            self.client.check()
            self._drain_acks()
            late = time.monotonic() - t0 >= timeout or (
                self.stop_requested.is_set() and source == "waiting"
            )
            if self.io.news(self._flat, wait=WAIT_POLL_S, halt=late)[1]:
                break
        self.add_badput(source, time.monotonic() - t0)

    def _linger(self) -> None:
        """Keep taking new global values for --linger-s (or until stopped)."""
        t0 = time.monotonic()
        while True:
            late = time.monotonic() - t0 >= self.settings.linger_s or self.stop_requested.is_set()
            if self.io.news(self._flat, wait=0.2, halt=late)[1]:
                return
            self.heartbeat(done=True)

    # --- what it tells ----------------------------------------------------------------------
    def add_badput(self, source: str, seconds: float) -> None:
        """Learner seconds that did not become merged progress, by source."""
        self.badput[source] += seconds
        tm.BADPUT_SECONDS.labels(source=source).inc(seconds)

    def record(self, kind: str, **fields: Any) -> None:
        """A tape event with where this incarnation stands: step and fragment versions."""
        self.tape.write(
            kind,
            incarnation=self.incarnation,
            step=self.standing.step,
            versions=[f.version for f in self.outer.fragments],
            **fields,
        )

    def _uid(self, seq: int) -> str:
        """An update's id, as the synchronizer and the commit log name it."""
        return f"{self.settings.id}/{self.incarnation}/{seq}"

    def heartbeat(
        self, done: bool = False, last_sent: bool = False, still_to_send: list[int] | None = None
    ) -> None:
        """Tell the synchronizer where this learner stands (step, speed, losses); only the
        process that holds the learner's session speaks."""
        if not self.io.speaks:
            return
        self._last_heartbeat = time.monotonic()
        if self.client.stats.reconnects != self._reconnects_seen:
            self._reconnects_seen = self.client.stats.reconnects
            self.tape.write("reconnected", reconnects=self._reconnects_seen)
        standing = self.standing
        self.client.heartbeat(
            step=standing.step,
            step_time_ema_s=standing.ema_step_s,
            tokens_per_s=standing.tokens_per_s(),
            loss=standing.loss,
            eval_loss=standing.eval_loss,
            done=done,
            last_sent=last_sent,  # the synchronizer takes `done` as saying it too
            still_to_send=still_to_send,
        )


def parse_routes(items: list[str]) -> dict[str, str]:
    """`--route ADVERTISED=REACHABLE[,...]` as a mapping; a malformed one is refused."""
    routes = {}
    for item in (r for entry in items for r in entry.split(",") if r):
        advertised, sep, reachable = item.partition("=")
        if not sep or not advertised or not reachable:
            raise ValueError(f"--route {item!r} is not ADVERTISED=REACHABLE (HOST:PORT=HOST:PORT)")
        routes[advertised] = reachable
    return routes
