"""atoll learner: what a user may import, to turn their own JAX training loop into a learner
of a job (docs/learner.md, "Your own training loop"), or to hand `atoll learner` their own
model. Everything else under `learner` may change without notice.

- `SyncEngine`: joins a job and syncs a loop's parameters with it, through its hooks
  (`SyncHooks`: join, after_step, finish, done);
- `Checkpointer`: the slot's local checkpoints, which the loop writes and the engine restores;
- `LearnerSettings`: the learner's settings (the flags of `atoll learner`);
- `Workload` and `Batches`: what `--model module:function` returns, and its batch source;
- `SessionError`: raised when the synchronizers refuse the learner for good.

Names are imported on first use, so importing a module of the package (the settings, say)
does not load JAX or gRPC.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from learner.checkpointer import Checkpointer
    from learner.client import SessionError
    from learner.data import Batches
    from learner.hooks import SyncHooks
    from learner.settings import LearnerSettings
    from learner.sync import SyncEngine
    from learner.workload import Workload

__all__ = [
    "Batches",
    "Checkpointer",
    "LearnerSettings",
    "SessionError",
    "SyncEngine",
    "SyncHooks",
    "Workload",
]

_HOMES = {
    "Batches": "learner.data",
    "Checkpointer": "learner.checkpointer",
    "LearnerSettings": "learner.settings",
    "SessionError": "learner.client",
    "SyncEngine": "learner.sync",
    "SyncHooks": "learner.hooks",
    "Workload": "learner.workload",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'learner' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
