"""The fragment I/O of a learner of one process: every fragment whole, on its devices.

It joins (sending the job's initial values when this learner holds the claim, or waiting
for the learner that does), takes each update's values off the parameters as a device-side
copy, and adopts each new global value the session's Follow calls bring. With a codec
encoded on the device (int8, int4) each fragment's anchor stays there too, so an update's
outer gradient never crosses to the host as float32, and a reply that keeps the overlap's
progress is rebased on the device (`theta <- Theta + (theta - theta_sent)`).

Threads: the caller's thread (the engine's) joins, takes, adopts; the stager thread places
each arriving global value that answers an update in flight on the device, off the loop,
and hands the values on in arrival order; the encoder thread runs what `take` returns. It
also serves the slot's local checkpoint (learner/checkpointer.py): what it holds of each
fragment, and moving a restored fragment onto the job's current value.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import structlog

from learner import checkpoint as ckpt
from learner import device_codec
from learner.checkpointer import Checkpointer, Restored, device_copy
from learner.client import GlobalFragment
from learner.fragment_io import Joined, Link, Outgoing
from learner.hostile import corrupt
from learner.outer import OuterState, Send
from learner.workload import FlatParams
from services import codec as codecs
from services.config import INIT_CLAIM_S
from services.gen.atoll.v1 import session_pb2
from services.layout import FragmentLayout, fragment_layout

log = structlog.get_logger("atoll.learner")
INIT_POLL_S = 0.2  # how often a learner waiting for the job's initial parameters asks
INIT_SEND_S = 60.0  # how long the initial values may take to be acknowledged


class WholeFragments:
    """`FragmentIO` (learner/fragment_io.py) for a learner of one process."""

    def __init__(self, checkpoints: Checkpointer | None = None) -> None:
        self.speaks = True
        self.version_notices = False
        self.tape_fields: dict[str, Any] = {}
        self.checkpoints = checkpoints
        # Global values that arrived, each with its leaves already on the device when the
        # loop will rebase onto them there (placed by the stager thread, off the loop).
        self._arrivals: queue.Queue[tuple[GlobalFragment, list[jax.Array] | None]] = queue.Queue()
        self._closing = threading.Event()
        self._stager: threading.Thread | None = None
        self._sent: dict[int, dict[str, jax.Array]] = {}  # in flight: the leaves as sent
        # With a codec encoded on the device (int8, int4): each fragment's anchor there too,
        # in layout order, so an update's outer gradient never crosses as float32.
        self._anchors: dict[int, list[jax.Array]] | None = None
        self._shardings: dict[str, Any] = {}

    def incarnation(self, mine: str) -> str:
        return mine

    # --- joining --------------------------------------------------------------------------
    def join(self, link: Link, initial: Any, sharding: Any) -> Joined:
        self.link, client = link, link.client
        welcome = client.connect(link.stop_requested)
        cfg = self.config = welcome.config
        self.layout: FragmentLayout = fragment_layout(link.specs, cfg.fragments)
        codec = codecs.by_wire(cfg.codec)
        hostile = link.settings.hostile
        # A hostile learner (the defences' tests) corrupts its updates on the host.
        on_device = device_codec.supports(codec) and hostile is None
        # Fragments still at the value this learner initialized (same model and seed) are
        # not sent again: only their checksums travel. Once the job has moved on, this
        # learner's initial values can match nothing: they are not even made.
        mine: dict[int, np.ndarray] = {}
        if not welcome.initialized or not any(welcome.versions):
            made = link.named.flatten(initial() if callable(initial) else initial).items()
            flat = {k: np.asarray(v, np.float32) for k, v in made}
            mine = {p: self.layout.gather(p, flat) for p in range(cfg.fragments)}
        fetched: list[GlobalFragment] | None = None
        if not welcome.initialized and not welcome.initializer:
            fetched = self._await_initial(mine)  # another learner is sending them
        if not welcome.initialized and fetched is None:
            for p in range(cfg.fragments):
                client.send_initial(p, mine[p])
            deadline = time.monotonic() + INIT_SEND_S
            while client.unacked() and time.monotonic() < deadline:
                client.check()
                time.sleep(0.05)
        if fetched is None:
            fetched = client.fetch_state(held=mine)
        globals_ = sorted(fetched, key=lambda g: g.fragment)
        if len(globals_) != cfg.fragments:
            raise RuntimeError(
                f"fetched {len(globals_)} of {cfg.fragments} global fragments; retry"
            )
        self.outer = OuterState.start(
            [(g.version, g.values) for g in globals_],
            codec,
            cfg.block_size,
            keep_progress=cfg.keep_overlap_progress,
            tensor_sizes=[tuple(leaf.size for leaf in f.leaves) for f in self.layout.fragments],
            feedback=device_codec.DeviceFeedback if on_device else codecs.ErrorFeedback,
        )
        for f in self.outer.fragments:
            # Decoupled rounds seal without updates still crossing the link: the reply is
            # the version the update's ack names (learner/outer.py). A sync round holds
            # every learner's update, and the learner waits for it.
            f.confirm_by_ack = cfg.mode == "decoupled"
        if hostile is not None:
            rng = np.random.default_rng([link.settings.seed, link.settings.shard, 0xBAD])
            for f in self.outer.fragments:
                f.hostile = functools.partial(corrupt, hostile, rng=rng)
            log.warning("hostile_learner", kind=hostile, hint="for the defences' tests only")
        values: dict[str, np.ndarray] = {}
        for g in globals_:
            values.update(self.layout.scatter(g.fragment, g.values))
        params = jax.device_put(link.named.unflatten(values), sharding)  # type: ignore[arg-type]
        placed = link.named.flatten(params)
        self._shardings = {n: leaf.sharding for n, leaf in placed.items()}
        if on_device:
            self._anchors = {}
            for p, f in enumerate(self.outer.fragments):
                # Copies (the loop may donate the parameters); the send's copy, the rebase
                # and the encoder are compiled for them before the first sync.
                self._set_anchor(p, {n: jnp.copy(placed[n]) for n in self._names(p)})
                leaves = self._anchors[p]
                _rebase(leaves, leaves, device_copy(leaves))
                if isinstance(f.feedback, device_codec.DeviceFeedback):
                    link.encoder.submit(f.feedback.warm, leaves)
        if self._stager is None:  # one, so arrivals keep their order
            self._stager = threading.Thread(target=self._stage, name="atoll-stage", daemon=True)
            self._stager.start()
        log.info(
            "joined",
            learner=link.settings.id,
            incarnation=client.incarnation,
            mode=cfg.mode,
            fragments=cfg.fragments,
            inner_steps=cfg.inner_steps,
            codec=codec.name,
            encodes_on="host" if self._anchors is None else "device",
            versions=[g.version for g in globals_],
            initialized_job=not welcome.initialized,
        )
        if self.checkpoints is not None:
            self.checkpoints.attach(self)
            params = self._restore(params)
        return Joined(cfg, self.outer, params)

    def _await_initial(self, mine: dict[int, np.ndarray]) -> list[GlobalFragment] | None:
        """The job's initial values, once the learner holding the claim has sent them; None
        if they did not come while its claim lasted (then this learner sends its own)."""
        deadline = time.monotonic() + INIT_CLAIM_S + 5.0
        while time.monotonic() < deadline and not self.link.stop_requested.is_set():
            try:
                return self.link.client.fetch_state(held=mine)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
            time.sleep(INIT_POLL_S)
        log.warning("initial_parameters_late", learner=self.link.settings.id)
        return None

    # --- news -----------------------------------------------------------------------------
    def news(self, flat: FlatParams, *, wait: float, halt: bool) -> tuple[bool, bool]:
        """Adopt the global values that arrived; a learner of one process decides alone
        when to stop waiting (it does once nothing more arrives)."""
        adopted = False
        timeout = 0.0 if halt else wait
        while True:
            try:
                g, placed = self._arrivals.get(timeout=timeout)
            except queue.Empty:
                break
            timeout = 0.0
            f = self.outer.fragments[g.fragment]
            if f.receive(g.values, g.version, time.monotonic()):
                self._adopt(flat, g.fragment, g.values, g.version, placed)
                adopted = True
        now = time.monotonic()
        for p, f in enumerate(self.outer.fragments):
            if f.overdue(now):  # its ack is lost: the first newer version, as without acks
                log.warning("reply_unconfirmed", fragment=p, version=f.latest_version)
                assert f.latest is not None
                self._adopt(flat, p, f.latest, f.latest_version)
                adopted = True
        return adopted, halt and not adopted

    def final_ack(self, seq: int) -> session_pb2.Ack | None:
        return self.link.client.stats.acks.get(seq)

    def job_finished(self) -> bool:
        return self.link.client.job_finished

    def _stage(self) -> None:
        """The stager thread: each global value that arrives, with its leaves copied onto
        the device when it answers an update in flight (the copies are the host's work; the
        loop only dispatches the rebase), handed to the loop in arrival order."""
        while not self._closing.is_set():
            try:
                g = self.link.client.fragments.get(timeout=0.2)
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

    # --- values ---------------------------------------------------------------------------
    def take(self, p: int, send: Send, flat: FlatParams) -> Outgoing:
        f = self.outer.fragments[p]
        names = self._names(p)
        # A device-side copy: the loop's step may donate the parameters' buffers. It also
        # stays on the device until the reply comes: the rebase is computed there.
        snapshot: list[jax.Array] = device_copy([flat[n] for n in names])
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

        return Outgoing(encode, self.layout.fragments[p].num_elements)

    def adopt(self, flat: FlatParams, p: int, value: np.ndarray, version: int) -> None:
        self._adopt(flat, p, value, version)

    def _adopt(
        self,
        flat: FlatParams,
        p: int,
        value: np.ndarray,
        version: int,
        placed: list[jax.Array] | None = None,
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
            rebased = _rebase(placed, [flat[n] for n in names], [sent[n] for n in names])
            flat.update(zip(names, rebased, strict=True))
            f.adopt(value, version)
            self._set_anchor(p, incoming)
            return
        alpha = self.config.merge_alpha
        needs_local = alpha or (f.keep_progress and f.sent_theta is not None)
        theta = self.layout.gather(p, _host_leaves(flat, self._names(p))) if needs_local else value
        merged = f.local_value(theta, value, alpha)
        f.adopt(value, version)
        for name, leaf in self.layout.scatter(p, merged).items():
            flat[name] = jax.device_put(jnp.asarray(leaf), flat[name].sharding)
        if self._anchors is not None:  # the global value, which `merged` may not be
            self._set_anchor(
                p,
                {
                    name: jax.device_put(jnp.asarray(leaf), flat[name].sharding)
                    for name, leaf in self.layout.scatter(p, value).items()
                },
            )

    def refetch(self, flat: FlatParams, fragments: set[int]) -> set[int]:
        """Fetch and adopt the current global value; if no synchronizer answers now, the
        next step tries again (the session reconnects)."""
        try:
            fetched = self.link.client.fetch_state(sorted(fragments), retry=False)
        except (grpc.RpcError, ValueError) as err:
            log.info("refetch_deferred", fragments=sorted(fragments), error=str(err))
            return fragments
        left = set(fragments)
        for g in fetched:
            self.outer.fragments[g.fragment].receive(g.values, g.version)
            self._adopt(flat, g.fragment, g.values, g.version)
            left.discard(g.fragment)
        return left

    def global_params(self, sharding: Any) -> Any:
        flat: dict[str, np.ndarray] = {}
        for p, f in enumerate(self.outer.fragments):
            newer = f.latest is not None and f.latest_version > f.version
            flat.update(self.layout.scatter(p, f.latest if newer else f.base))  # type: ignore[arg-type]
        return jax.device_put(self.link.named.unflatten(flat), sharding)  # type: ignore[arg-type]

    def checksums(self, flat: FlatParams) -> list[int]:
        return [
            codecs.checksum(self.layout.gather(p, _host_leaves(flat, self._names(p))).tobytes())
            for p in range(self.config.fragments)
        ]

    def report(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self._closing.set()
        if self._stager is not None:  # never left inside the runtime as the process exits
            self._stager.join()

    def _names(self, p: int) -> list[str]:
        return [leaf.name for leaf in self.layout.fragments[p].leaves]

    def _set_anchor(self, p: int, leaves: dict[str, jax.Array]) -> None:
        """Fragment p's anchor on the device (buffers the loop never donates), when its
        updates are encoded there."""
        if self._anchors is not None:
            self._anchors[p] = [leaves[n] for n in self._names(p)]

    def _place(self, p: int, value: np.ndarray) -> list[jax.Array]:
        """Fragment p's `value` as its leaves on the device, in layout order."""
        names = self._names(p)
        host = self.layout.scatter(p, value)
        placed: list[jax.Array] = jax.device_put(
            [host[n] for n in names], [self._shardings[n] for n in names]
        )
        return placed

    # --- the slot's local checkpoint ------------------------------------------------------
    def checkpoint_key(self) -> dict[str, Any]:
        """What a checkpoint must match to be restored: this job, slot and layout."""
        return {
            "job": self.link.settings.job,
            "learner": self.link.settings.id,
            "fragments": self.config.fragments,
            "inner_steps": self.config.inner_steps,
        }

    def checkpoint_state(
        self, arrays: dict[str, np.ndarray]
    ) -> tuple[list[dict[str, Any]], Future[list[ckpt.EncoderHeld]]]:
        """Each fragment's bookkeeping as the loop's thread owns it (anchors into `arrays`),
        and what the encoder thread holds, taken there after the sends queued before."""
        fragments = self.outer.fragments
        records = [ckpt.fragment_record(p, f, arrays) for p, f in enumerate(fragments)]
        in_flight = [record["awaiting_above"] is not None for record in records]
        held = self.link.encoder.submit(
            lambda: [ckpt.encoder_held(f, i) for f, i in zip(fragments, in_flight, strict=True)]
        )
        return records, held

    def _restore(self, params: Any) -> Any:
        """This slot's local checkpoint, if there is one for this job and model, with every
        fragment moved onto the job's current value (`params`), keeping the progress made
        since its anchor; the checkpointer keeps what the loop restores."""
        assert self.checkpoints is not None
        current_flat = self.link.named.flatten(params)
        loaded = self.checkpoints.read(self.checkpoint_key(), list(current_flat))
        if loaded is None:
            return params
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
        restored = Restored(self.link.named.unflatten(placed), loaded.opt_leaves, loaded.meta)
        self.checkpoints.restored = restored
        log.info(
            "restored",
            learner=self.link.settings.id,
            step=int(loaded.meta["step"]),
            versions=[f.version for f in self.outer.fragments],
        )
        return restored.params


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


def _host_leaves(flat: FlatParams, names: list[str]) -> dict[str, np.ndarray]:
    return dict(zip(names, jax.device_get([flat[n] for n in names]), strict=True))


@jax.jit
def _rebase(
    incoming: list[jax.Array], theta: list[jax.Array], sent: list[jax.Array]
) -> list[jax.Array]:
    """Each new global value plus the local progress since the update was taken (float32,
    as learner.outer.rebase computes it on the host): one dispatch for a fragment."""
    return [i + (t - s) for i, t, s in zip(incoming, theta, sent, strict=True)]
