"""The learner's side of the outer loop, as pure decisions over numpy arrays.

Fragment p is due every H steps, the P fragments staggered by H/P steps. When it is due,
the outer gradient `base_p - theta_p` is encoded with error feedback and sent with the
counters since the anchor. The learner then adopts the first global value newer than any it
knew when it sent: that version holds its own update (a round takes each learner's oldest
pending update). Values that other learners' rounds produce in between are remembered but
not adopted, so no unsent local progress is overwritten. A fragment is not sent again before
its reply arrives, so no progress is ever counted twice.

A round can seal while an update is still crossing a thin link, and commit a version without
it: the first newer version is then not the reply. So a decoupled learner of one process
(`confirm_by_ack`) adopts the version its update's COMMITTED ack names (or a newer one),
holding a value that arrives first until the ack does; were the ack lost, after ACK_WAIT_S it
adopts the first newer version, as without acks. Adopting a version without its own update
would take the update's progress out of the local model until a later round merged it, and
send the next update of the fragment while the last one still waited in an open round (which
its owner refuses: one update a learner per round), losing that update's steps.

Steps taken while an update is in flight (the overlap) are kept by default: the reply is
applied as `theta <- Theta + (theta - theta_sent)`, and their counters go into the next
update. With `keep_progress` off the reply overwrites them (`merge_global`), and their
compute is lost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from services.codec import Codec, ErrorFeedback, Segment

# How long a learner confirming by ack holds a newer version before adopting it without the
# ack (a session that reconnected is not told of commits before it; the update is sent again
# and acked as a duplicate, so this only bounds what a lost ack costs).
ACK_WAIT_S = 10.0


def fragment_offset(fragment: int, fragments: int, inner_steps: int) -> int:
    """Step (mod H) at which a fragment is due: (p+1)*H/P, so the last one is due at H."""
    return ((fragment + 1) * inner_steps // fragments) % inner_steps


def due_fragments(step: int, fragments: int, inner_steps: int) -> list[int]:
    """Fragments due after `step` inner steps (step >= 1)."""
    if step < 1:
        return []
    return [
        p
        for p in range(fragments)
        if step % inner_steps == fragment_offset(p, fragments, inner_steps)
    ]


def rebase(theta: np.ndarray, sent: np.ndarray, global_value: np.ndarray) -> np.ndarray:
    """The new global value plus the local progress made since the update was taken."""
    return np.asarray(global_value + (theta - sent), np.float32)


def sync_round(step: int, fragment: int, fragments: int, inner_steps: int) -> int:
    """Which round of a fragment a sync-mode learner contributes to at a due `step`: the
    number of the fragment's due steps up to it (the round that makes version n is round n)."""
    offset = fragment_offset(fragment, fragments, inner_steps)
    return step // inner_steps if offset == 0 else (step - offset) // inner_steps + 1


def merge_global(theta: np.ndarray, global_value: np.ndarray, alpha: float) -> np.ndarray:
    """theta <- alpha*theta + (1-alpha)*Theta (alpha=0: overwrite, the paper's default)."""
    if alpha == 0.0:
        return global_value.copy()
    return (alpha * theta + (1.0 - alpha) * global_value).astype(np.float32)


class Feedback(Protocol):
    """A fragment's error feedback: services.codec.ErrorFeedback on the host, or
    learner.device_codec.DeviceFeedback, whose residual stays on the learner's device."""

    norms: tuple[float, ...]  # each tensor's L2 norm of what the last encoding decodes to

    @property
    def residual(self) -> np.ndarray | None: ...

    @residual.setter
    def residual(self, value: np.ndarray | None) -> None: ...

    def encode(self, delta: np.ndarray) -> list[Segment]: ...


class FeedbackFactory(Protocol):
    def __call__(
        self, codec: Codec, block_size: int, *, tensor_sizes: tuple[int, ...]
    ) -> Feedback: ...


@dataclass(frozen=True)
class Send:
    """One update as taken at its step: the anchor and the counters since it."""

    base: np.ndarray
    version: int
    steps: int
    tokens: int
    compute_seconds: float


@dataclass
class FragmentState:
    """What a learner keeps per fragment between two syncs."""

    base: np.ndarray  # anchor: the global value the local fragment evolves from
    version: int
    feedback: Feedback
    steps: int = 0
    tokens: int = 0
    compute_seconds: float = 0.0
    latest_version: int = -1  # newest global version seen (maybe not adopted)
    latest: np.ndarray | None = None
    awaiting_above: int | None = None  # sent: adopt the first version above this
    due: bool = False  # due, but its previous send is still in flight
    keep_progress: bool = True  # steps taken while in flight survive the reply
    # The fragment as the in-flight update took it: on the host, or left on the device
    # (np.asarray brings it over).
    sent_theta: npt.ArrayLike | None = None
    # A hostile learner's corruption of each update (delta, anchor -> what it sends); the
    # defences' tests only (learner/hostile.py).
    hostile: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
    confirm_by_ack: bool = False  # adopt the version the update's ack names (module doc)
    sent_seq: int | None = None  # the in-flight update's number, once the client gave it
    merged_in: int | None = None  # the version its ack says holds it
    unconfirmed_since: float | None = None  # when a newer version came before the ack

    @property
    def in_flight(self) -> bool:
        return self.awaiting_above is not None

    def count(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.compute_seconds += seconds

    def begin_send(self) -> Send:
        """Take what an update needs at this step, and start waiting for its reply."""
        send = Send(self.base, self.version, self.steps, self.tokens, self.compute_seconds)
        self.awaiting_above = max(self.version, self.latest_version)
        self.due = False
        self.sent_seq = self.merged_in = self.unconfirmed_since = None
        if self.keep_progress:  # the update carries these; what follows counts anew
            self.steps, self.tokens, self.compute_seconds = 0, 0, 0.0
        return send

    def encode(self, send: Send, theta: np.ndarray) -> list[Segment]:
        """The outer gradient base - theta, encoded with error feedback (any thread; one at a
        time per fragment, as the residual carries over)."""
        self.sent_theta = theta
        delta = (send.base - theta).astype(np.float32)
        if self.hostile is not None:
            delta = self.hostile(delta, send.base)
        return self.feedback.encode(delta)

    def receive(self, value: np.ndarray, version: int, now: float = 0.0) -> bool:
        """A global value arrived (at `now`, monotonic seconds); return True if it is the
        reply to adopt now."""
        if version <= max(self.version, self.latest_version):
            return False
        self.latest, self.latest_version = value, version
        if (
            self.confirm_by_ack
            and self.unconfirmed_since is None
            and self.awaiting_above is not None
            and version > self.awaiting_above
        ):
            self.unconfirmed_since = now  # a reply may be here: the wait for its ack starts
        return self.answers(version, now)

    def answers(self, version: int, now: float) -> bool:
        """Whether `version` is the in-flight update's reply: the first above what the
        learner knew when it sent; confirming by ack, one at or above the version the ack
        names, or the first above once ACK_WAIT_S has passed without the ack (counted from
        when the first such version arrived)."""
        if self.awaiting_above is None or version <= self.awaiting_above:
            return False
        if not self.confirm_by_ack:
            return True
        if self.merged_in is not None:
            return version >= self.merged_in
        since = self.unconfirmed_since
        return since is not None and now - since >= ACK_WAIT_S

    def confirmed(self, seq: int, version: int) -> bool:
        """The ack of update `seq`: merged by `version` (COMMITTED, or a DUPLICATE of one
        merged by then). Returns whether the newest value known is now the reply to adopt
        (`latest`)."""
        if not self.confirm_by_ack or self.awaiting_above is None or seq != self.sent_seq:
            return False
        self.merged_in = version
        return self.latest is not None and self.answers(self.latest_version, 0.0)

    def overdue(self, now: float) -> bool:
        """Whether a newer version has waited ACK_WAIT_S for an ack that has not come: it
        is adopted (`latest`) as the reply."""
        return (
            self.merged_in is None
            and self.unconfirmed_since is not None
            and self.latest is not None
            and self.answers(self.latest_version, now)
        )

    def local_value(self, theta: np.ndarray, global_value: np.ndarray, alpha: float) -> np.ndarray:
        """What the local fragment becomes when `global_value` is adopted."""
        if self.keep_progress and self.sent_theta is not None:
            return rebase(theta, np.asarray(self.sent_theta, np.float32), global_value)
        return merge_global(theta, global_value, alpha)

    def carry_onto(self, theta: np.ndarray, global_value: np.ndarray, version: int) -> np.ndarray:
        """Move this fragment onto the job's current value and return the new local value,
        keeping the progress made since its anchor (or, with an update in flight, since
        that update was taken: the update itself is the synchronizer's now). A learner
        restored from its checkpoint does this on rejoining, so its next update is based on
        the current version instead of a stale one. Without kept progress it overwrites."""
        if self.keep_progress:
            taken = self.in_flight and self.sent_theta is not None
            ref = np.asarray(self.sent_theta, np.float32) if taken else self.base
            local = rebase(theta, ref, global_value)
        else:
            local = global_value.copy()
            self.steps, self.tokens, self.compute_seconds = 0, 0, 0.0
        self.base, self.version = global_value, version
        self.latest, self.latest_version = None, max(self.latest_version, version)
        self.awaiting_above, self.sent_theta, self.due = None, None, False
        self.sent_seq = self.merged_in = self.unconfirmed_since = None
        return local

    def adopt(self, global_value: np.ndarray, version: int) -> None:
        """The reply arrived (or the state was re-fetched): the new anchor. Counters restart,
        unless the steps since the send were kept (they count toward the next update)."""
        kept = self.keep_progress and self.sent_theta is not None
        self.base = global_value
        self.version = version
        self.latest_version = max(self.latest_version, version)
        self.awaiting_above = None
        self.sent_theta = None
        self.due = False  # a sync that waited for this reply has nothing left to send
        self.sent_seq = self.merged_in = self.unconfirmed_since = None
        if not kept:
            self.steps, self.tokens, self.compute_seconds = 0, 0, 0.0


@dataclass
class OuterState:
    fragments: list[FragmentState] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        globals_: list[tuple[int, np.ndarray]],
        codec: Codec,
        block_size: int,
        keep_progress: bool = True,
        tensor_sizes: list[tuple[int, ...]] | None = None,
        feedback: FeedbackFactory = ErrorFeedback,
    ) -> OuterState:
        """`tensor_sizes`: each fragment's tensors, whose norms each update reports;
        `feedback` makes each fragment's error feedback."""
        sizes = tensor_sizes or [() for _ in globals_]
        return cls(
            [
                FragmentState(
                    value.copy(),
                    version,
                    feedback(codec, block_size, tensor_sizes=sizes[p]),
                    keep_progress=keep_progress,
                )
                for p, (version, value) in enumerate(globals_)
            ]
        )
