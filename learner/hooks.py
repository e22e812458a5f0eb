"""The hooks a training loop calls to be a learner of a job, and nothing else.

`learner.sync.SyncEngine` is the one implementation; the built-in loop (learner/loop.py)
knows only this interface, so it imports nothing of how bytes travel. Every hook takes what
the loop knows as explicit arguments and returns what the loop needs back; the loop never
reads or writes the engine's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class SyncHooks(Protocol):
    incarnation: str  # this process start of the learner slot (a fresh uuid)

    def join(
        self,
        initial: Any | Callable[[], Any],
        sharding: Any = None,
        *,
        step: int = 0,
        tokens: int = 0,
    ) -> Any:
        """Join the job; return its global parameters (a restored checkpoint's moved onto
        them, when the engine was given checkpoints)."""

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
        """After each inner step: the parameters back, newly adopted fragments written in."""

    def job_finished(self) -> bool:
        """Whether the job's budget of steps is spent: the loop stops and finishes."""

    def global_params(self, sharding: Any = None) -> Any:
        """The global model as last seen: what an eval measures."""

    def finish(
        self, params: Any, *, compute_seconds: float = 0.0, eval_loss: float | None = None
    ) -> Any:
        """The final sync: the parameters back, now the global model."""

    def done(self, params: Any, eval_loss: float | None = None) -> dict[str, Any]:
        """The last heartbeat; the learner's summary of the job (versions, checksums,
        bytes, badput by source)."""
