"""What the sync engine is given to move fragments between the parameters and the wire.

The engine (learner/sync.py) decides: what is due, what is in flight, which ack settles
which update, when to wait and when to stop waiting. Its fragment I/O carries out what
touches values and news:
- `WholeFragments` (learner/whole_fragments.py): a learner of one process, which holds
  every fragment whole, follows new global values itself and encodes on its device;
- `ProcessRanges` (learner/process_ranges.py): one process of a learner that spans several,
  which holds, sends and fetches only its own ranges of each fragment, and takes its news
  at the ticks its leader publishes.

Both run on the caller's thread, except what `take` returns (the encoder thread runs it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from learner.client import SynchronizerClient
from learner.outer import OuterState, Send
from learner.settings import LearnerSettings
from learner.workload import FlatParams, Named
from services.codec import Segment
from services.gen.atoll.v1 import session_pb2
from services.layout import LeafSpec


@dataclass(frozen=True)
class Link:
    """What a fragment I/O works with, handed over by the engine when it joins."""

    settings: LearnerSettings
    client: SynchronizerClient
    named: Named
    specs: list[LeafSpec]
    encoder: ThreadPoolExecutor  # the engine's encoder thread (one: feedback stays in order)
    stop_requested: threading.Event


@dataclass(frozen=True)
class Joined:
    """What joining gave: the job's configuration, each fragment's outer state (anchored at
    its global value) and the parameters set to the global model."""

    config: session_pb2.JobConfig
    outer: OuterState
    params: Any


@dataclass(frozen=True)
class Outgoing:
    """One update as the loop's thread took it: `encode` (run on the encoder thread) gives
    its segments; the rest says which values of the fragment they are and under which seq."""

    encode: Callable[[], list[Segment]]
    num_elements: int
    seq: int | None = None  # None: the client numbers it
    part: int = 0
    parts: int = 0


class FragmentIO(Protocol):
    """The engine's fragment I/O. `flat` is the parameters as named leaves during a call of
    the engine: `adopt` writes adopted values into it."""

    speaks: bool  # this process holds the learner's session: heartbeats go from it
    version_notices: bool  # the session is told new versions, not sent their values
    tape_fields: dict[str, Any]  # what every tape event of this process adds

    def incarnation(self, mine: str) -> str:
        """The learner's incarnation, given this process's own fresh one."""

    def join(self, link: Link, initial: Any, sharding: Any) -> Joined:
        """Join the job and return its global model, placed with `sharding`."""

    def news(self, flat: FlatParams, *, wait: float, halt: bool) -> tuple[bool, bool]:
        """Take what arrived (waiting up to `wait` for it): adopt new global values that
        answer updates in flight, settle acks. Returns (whether a reply was adopted, whether
        to stop waiting: `halt`, as this process or its leader decided it)."""

    def final_ack(self, seq: int) -> session_pb2.Ack | None:
        """An update's final ack, once it has one."""

    def job_finished(self) -> bool:
        """Whether the job's budget of steps is spent."""

    def take(self, p: int, send: Send, flat: FlatParams) -> Outgoing:
        """Fragment p's values for the update `send` began, copied off the parameters now."""

    def adopt(self, flat: FlatParams, p: int, value: np.ndarray, version: int) -> None:
        """Adopt fragment p's new global value into `flat`."""

    def refetch(self, flat: FlatParams, fragments: set[int]) -> set[int]:
        """Move `fragments` (whose updates were refused) onto the current global value;
        return those that could not be now."""

    def global_params(self, sharding: Any) -> Any:
        """The global model as this process last saw it."""

    def checksums(self, flat: FlatParams) -> list[int]:
        """Each fragment's checksum as this learner ends on it."""

    def report(self) -> dict[str, Any]:
        """What this process adds to the engine's summary."""

    def close(self) -> None:
        """Stop the threads of its own."""
