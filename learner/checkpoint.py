"""A learner slot's local checkpoint: what a restarted learner goes on from.

Without it, a learner killed between two syncs loses every step since each fragment's last
send. With it (`--state-dir`), the slot writes, every `--checkpoint-every` steps (default:
every step, at most one per `--checkpoint-seconds`, and none while the last is still being
written), its parameters, its inner optimizer state, each fragment's outer bookkeeping
(anchor, version, counters, error-feedback residual, the update in flight) and its place in
the data, in one file replaced atomically. A new incarnation of the slot restores it after
joining, so only the steps since the last checkpoint are lost.

On rejoining, every restored fragment moves onto the job's current value, keeping the
progress made since its anchor (`FragmentState.carry_onto`), so the learner trains the
current model and its next update is not stale. An update the dead incarnation had in
flight is not sent again (its id belonged to it): if the synchronizer had accepted it, it is
merged; if not, its steps are lost; either way the local fragment keeps only the progress
made after it was taken.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from learner.outer import FragmentState

FORMAT = 1


@dataclass
class Snapshot:
    """Host copies of everything a checkpoint holds, taken between two steps."""

    meta: dict[str, Any]
    params: dict[str, np.ndarray]
    opt_leaves: list[np.ndarray]
    fragments: list[dict[str, Any]]
    arrays: dict[str, np.ndarray]


def fragment_record(p: int, f: FragmentState, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """One fragment's bookkeeping as the training thread owns it; its anchor goes into
    `arrays`. (What the encoder thread owns comes from `encoder_arrays`.)"""
    arrays[f"frag{p}/base"] = f.base
    return {
        "version": f.version,
        "steps": f.steps,
        "tokens": f.tokens,
        "compute_seconds": f.compute_seconds,
        "latest_version": f.latest_version,
        "awaiting_above": f.awaiting_above,
        "due": f.due,
    }


def encoder_arrays(
    p: int, f: FragmentState, in_flight: bool, arrays: dict[str, np.ndarray]
) -> None:
    """The residual, and the fragment the in-flight update took: the encoder thread sets
    both, so it reads them too, after the sends queued before the snapshot."""
    if in_flight and f.sent_theta is not None:
        arrays[f"frag{p}/sent_theta"] = f.sent_theta
    if f.feedback.residual is not None:
        arrays[f"frag{p}/residual"] = f.feedback.residual


def restore_fragment(
    p: int, f: FragmentState, record: dict[str, Any], arrays: dict[str, np.ndarray]
) -> None:
    f.base = np.asarray(arrays[f"frag{p}/base"], np.float32)
    f.sent_theta = arrays.get(f"frag{p}/sent_theta")
    f.feedback.residual = arrays.get(f"frag{p}/residual")
    f.version = int(record["version"])
    f.steps, f.tokens = int(record["steps"]), int(record["tokens"])
    f.compute_seconds = float(record["compute_seconds"])
    f.latest, f.latest_version = None, int(record["latest_version"])
    f.awaiting_above = None if record["awaiting_above"] is None else int(record["awaiting_above"])
    f.due = bool(record["due"])


def write(path: Path, snap: Snapshot) -> None:
    """One file, replaced atomically: a kill mid-write leaves the previous checkpoint."""
    arrays = dict(snap.arrays)
    arrays.update({f"param/{k}": v for k, v in snap.params.items()})
    arrays.update({f"opt/{i}": v for i, v in enumerate(snap.opt_leaves)})
    meta = {**snap.meta, "format": FORMAT, "fragment_states": snap.fragments}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **arrays)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        f.write(buffer.getbuffer())
    os.replace(tmp, path)


@dataclass
class Loaded:
    meta: dict[str, Any]
    params: dict[str, np.ndarray]
    opt_leaves: list[np.ndarray]
    arrays: dict[str, np.ndarray]

    @property
    def fragments(self) -> list[dict[str, Any]]:
        return list(self.meta["fragment_states"])


def read(path: Path) -> Loaded | None:
    """The checkpoint at `path`, or None if there is none or it cannot be read."""
    if not path.exists():
        return None
    try:
        with np.load(path) as data:
            arrays = {k: np.array(data[k]) for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, KeyError):
        return None
    meta = json.loads(arrays.pop("meta").tobytes())
    if meta.get("format") != FORMAT:
        return None
    params = {k.removeprefix("param/"): v for k, v in arrays.items() if k.startswith("param/")}
    opt = sorted(
        ((int(k.removeprefix("opt/")), v) for k, v in arrays.items() if k.startswith("opt/")),
        key=lambda kv: kv[0],
    )
    rest = {k: v for k, v in arrays.items() if k.startswith("frag")}
    return Loaded(meta, params, [v for _, v in opt], rest)


def matches(loaded: Loaded, expect: dict[str, Any], names: Sequence[str]) -> str | None:
    """Why this checkpoint cannot be used for this job and model (None: it can)."""
    for key, value in expect.items():
        if loaded.meta.get(key) != value:
            return f"{key} is {loaded.meta.get(key)!r} in the checkpoint, {value!r} now"
    if sorted(loaded.params) != sorted(names):
        return "the model's parameters differ"
    return None
