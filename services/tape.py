"""The tape: one JSON line per state change of every learner, synchronizer and the cluster.

Every process of a run appends to the same file (`--tape PATH`), each line one `write` to a
file opened with O_APPEND, so lines from several processes never interleave and a process
killed mid-run leaves every line it wrote whole (at worst the last one torn, which readers
skip). A line is `{"t": unix seconds, "who": "learner-0", "kind": "sent", ...fields}`.

Kinds, by writer:
- cluster: `run_started` (the job's settings), `launched` (a learner slot's process started;
  its first one starts the slot's provisioned time), `fault` (one injected), `killed`,
  `restarted`, `paused`, `resumed`, `training_ended` (every learner finished and every update
  merged), `merged` (commits found in Redis that no replica wrote down: one killed between
  its commit and its line), `run_ended`.
- learner: `joined` (incarnation, versions, resumed step), `step` (step, compute seconds),
  `sent` (uid, fragment, base version, compute seconds), `acked` (uid, status), `reconnected`,
  `finished` (checksums of the model it ends with).
- synchronizer: `started`, `owned` (fragment, epoch: it took the fragment's lease),
  `accepted` (uid, fragment, learner, the owner epoch it was recorded under), `merged`
  (fragment, version, uids, useful seconds, checksum of the new value).

`atoll check TAPE` and `atoll sim --tape TAPE` read it; `services.goodput` turns it into
goodput.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Tape:
    """Appends events for one writer (`who`); a Tape without a path writes nothing."""

    def __init__(self, path: Path | None, who: str) -> None:
        self.who = who
        self._fd: int | None = None
        self._lock = threading.Lock()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def write(self, kind: str, *, at: float | None = None, **fields: Any) -> None:
        """One event, stamped now (or `at`, for an event recorded after the fact)."""
        if self._fd is None:
            return
        when = time.time() if at is None else at
        event = {"t": round(when, 6), "who": fields.pop("who", self.who), "kind": kind}
        event.update(fields)
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is not None:
                os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read(path: Path) -> list[dict[str, Any]]:
    """Every whole event of a tape, in time order (a torn line from a killed writer is
    skipped)."""
    if not path.exists():
        raise FileNotFoundError(f"no tape at {path}; write one with `atoll up --tape {path}`")
    return sorted(_events(path), key=lambda e: float(e["t"]))


def _events(path: Path) -> Iterator[dict[str, Any]]:
    with path.open("rb") as f:
        for raw in f:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            if isinstance(event, dict) and "t" in event and "kind" in event:
                yield event
