"""When a slot's local checkpoint is taken, and its writing off the loop; reading it back.

Both the loop and the sync engine's fragment I/O are given the one `Checkpointer`. The
loop owns its parameters, its optimizer state and its place (step, tokens, data position):
it asks `due` after each step and hands them to `write`. The fragment I/O owns each
fragment's outer bookkeeping: it attaches itself as the `Source` when it joins (a learner
of several processes does not: it has no local checkpoint yet) and, when it finds a
checkpoint of this job, restores its fragments onto the job's current values and leaves
what the loop restores in `restored`.

Threads: `due`, `write` and `read` run on the loop's thread. `write` takes a device-side
copy (the next step may donate the buffers) whose copies to the host start at once; the
source's encoder thread hands over what it owns after the sends queued before; the writer
thread waits for the copies and writes the file (learner/checkpoint.py), so a large
checkpoint never holds up a step or an update behind it.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import structlog

from learner import checkpoint as ckpt
from learner.settings import LearnerSettings
from learner.workload import Named

log = structlog.get_logger("atoll.learner")
# At most this share of the loop's wall time has a checkpoint being taken: a checkpoint that
# takes 3 s to write comes at most every 100 s (and never more often than
# --checkpoint-seconds), so a large model's checkpoints never slow its steps much.
CHECKPOINT_SHARE = 0.03


@dataclass
class Restored:
    """What a slot's local checkpoint gave back: parameters moved onto the job's current
    values, the optimizer state's leaves, and the loop's place (step, tokens, position)."""

    params: Any
    opt_leaves: list[np.ndarray]
    meta: dict[str, Any]


class Source(Protocol):
    """What a checkpoint holds of the sync engine's state (its fragment I/O gives it)."""

    def checkpoint_key(self) -> dict[str, Any]:
        """What a checkpoint must match to be restored (job, slot, layout)."""

    def checkpoint_state(
        self, arrays: dict[str, np.ndarray]
    ) -> tuple[list[dict[str, Any]], Future[list[ckpt.EncoderHeld]]]:
        """Each fragment's record (its arrays into `arrays`) and what the encoder holds."""


class Checkpointer:
    """A slot's local checkpoints under `--state-dir`, every `--checkpoint-every` steps."""

    def __init__(self, settings: LearnerSettings) -> None:
        self.settings = settings
        self.slots = (
            None
            if settings.state_dir is None
            else ckpt.Slots(Path(settings.state_dir) / f"{settings.id}.checkpoint")
        )
        self.source: Source | None = None
        self.restored: Restored | None = None  # what `read` found, restored by the source
        self.write_s = 0.0  # how long the last checkpoint took to write
        # Checkpoints are written by a thread of their own: a large one takes seconds.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atoll-checkpoint")
        self._writing: Future[None] | None = None  # the last checkpoint
        self._last = -math.inf  # when the last one was taken (monotonic)

    def attach(self, source: Source) -> None:
        """The engine's state a checkpoint holds (its fragment I/O, once joined)."""
        self.source = source

    def ready(self) -> bool:
        """Whether a checkpoint can be taken now: the last one is written (the next is never
        queued behind it). Raises what failed its writing (a full disk, say): a learner
        whose checkpoints cannot be written stops, rather than train on with nothing to
        restart from."""
        if self.source is None or self.slots is None:
            return False
        if self._writing is None:
            return True
        if not self._writing.done():
            return False
        self._writing.result()
        return True

    def due(self, step: int) -> bool:
        """Whether to take one after `step`: every --checkpoint-every steps, at most one per
        --checkpoint-seconds, never queued behind one still being written."""
        every = self.settings.checkpoint_every
        if not every or step % every or not self.ready():
            return False
        now = time.monotonic()
        # Checkpoints come no more often than keeps their share of the loop's time within
        # CHECKPOINT_SHARE, by what the last one took to write, as the writer measured it (the
        # time until the loop next looked was a whole step: one checkpoint per 33 steps).
        spacing = max(self.settings.checkpoint_seconds, self.write_s / CHECKPOINT_SHARE)
        if now - self._last < spacing:
            return False
        self._last = now
        return True

    def write(self, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
        """Write a checkpoint of `params`, `opt_state` and the source's bookkeeping, without
        waiting for it. `meta`: the loop's place (step, tokens, data position)."""
        source, slots = self.source, self.slots
        assert source is not None
        assert slots is not None
        arrays: dict[str, np.ndarray] = {}
        records, held = source.checkpoint_state(arrays)
        meta = {**source.checkpoint_key(), **meta}
        flat, opt = device_copy((_named_leaves(params), opt_state))
        for leaf in jax.tree.leaves((flat, opt)):
            leaf.copy_to_host_async()

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
            self.write_s = time.monotonic() - t0

        self._writing = self._writer.submit(write)

    def read(self, key: dict[str, Any], names: list[str]) -> ckpt.Loaded | None:
        """This slot's newest whole checkpoint, if checkpoints are on and it is one of this
        job and model (`key`, the parameters' `names`)."""
        if self.slots is None or not self.settings.checkpoint_every:
            return None
        loaded = self.slots.read()
        if loaded is None:
            return None
        why = ckpt.matches(loaded, key, names)
        if why is not None:
            log.warning("checkpoint_ignored", learner=self.settings.id, reason=why)
            return None
        return loaded

    def close(self) -> None:
        """Wait for the checkpoint being written; say if it failed."""
        self._writer.shutdown(wait=True)
        failed = None if self._writing is None else self._writing.exception()
        if failed is not None:
            log.error("checkpoint_failed", error=repr(failed))


def _named_leaves(params: Any) -> dict[str, jax.Array]:
    """The parameters as named leaves (paths, as the fragment layout names them)."""
    return dict(Named.of(params).flatten(params))


@jax.jit
def device_copy(tree: Any) -> Any:
    """Fresh device buffers holding the same values (never donated, so a background
    thread may read them while the next steps run)."""
    return jax.tree.map(jnp.copy, tree)
