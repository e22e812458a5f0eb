"""A fragment's value at a version: its newest keyframe at or before it, plus the deltas after.

A commit writes one object before it moves the pointer: the encoded delta that makes its
version, the one learners download anyway. Every `VALUE_EVERY`-th version the owner also writes
a keyframe (the value, the optimizer state and the downlink residual) in the background, and
the commit after it names that keyframe. Each version is therefore the keyframe the pointer
names plus the deltas committed since, in float32, bit for bit what learners rebuild
(services/downlink.py); a log-structured store of this kind writes each value once per
`VALUE_EVERY` commits instead of each, so a merge's bytes are its delta's, whatever the model's
size.

A new owner after a failover resumes the value exactly, and the optimizer's trace and the
residual as of the keyframe (at most `VALUE_EVERY` versions old): the trace is a running
average, and a stale residual resends at most a quantum per value once.

An owner writes its fragment's keyframes through `Keyframes`; anyone reads a value at a
version through `value_at` (or `RebuiltValues`, which keeps the last one rebuilt).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import structlog

from services import codec as codecs
from services.downlink import apply_segment
from services.lifecycle import usable_cores
from synchronizer.records import Keyframe
from synchronizer.store.control import ControlStore, Pointer
from synchronizer.store.tensors import TensorStore, TensorStoreError, object_name, version_of

log = structlog.get_logger("atoll.synchronizer.values")
VALUE_EVERY = 8
_POOL = ThreadPoolExecutor(max_workers=usable_cores(), thread_name_prefix="atoll-rebuild")


class VersionGone(LookupError):
    """The version asked for can no longer be rebuilt (its keyframe or deltas were collected)."""


def delta_names(entries: Sequence[Mapping[str, Any]], after: int, upto: int) -> list[str]:
    """The delta objects of versions after..upto, in order, from commit log entries."""
    by_version = {int(e["version"]): str(e.get("delta", "")) for e in entries}
    names = [by_version.get(v, "") for v in range(after + 1, upto + 1)]
    if not all(names):
        missing = [v for v, n in zip(range(after + 1, upto + 1), names, strict=True) if not n]
        raise VersionGone(f"the commit log no longer names the deltas of versions {missing}")
    return names


def rebuild(
    base: np.ndarray, deltas: Sequence[codecs.Payload], codec: codecs.Codec, block_size: int
) -> np.ndarray:
    """`base` plus each encoded delta in turn, as the commits added them (a new array)."""
    out = np.array(base, np.float32)
    for blob in deltas:
        segments = codecs.unpack_segments(blob)
        # Segments are disjoint: added side by side (the compiled decoders release the GIL).
        list(_POOL.map(lambda s: apply_segment(out, out, s, codec, block_size), segments))
    return out


def keyframe_version(pointer: Pointer) -> int:
    return version_of(pointer.value)


async def value_at(
    store: ControlStore,
    tensors: TensorStore,
    fragment: int,
    codec: codecs.Codec,
    block_size: int,
    version: int | None = None,
    *,
    pointer: Pointer | None = None,
    cached: tuple[int, np.ndarray] | None = None,
) -> tuple[int, np.ndarray]:
    """The fragment's float32 value at `version` (None: the committed one) and that version.
    `cached`, a value already rebuilt at some version, is started from when it is at or
    after the keyframe used (fewer deltas to add). Raises VersionGone when it is no longer
    kept, LookupError when the fragment has no value yet."""
    pointer = pointer or await store.pointer(fragment)
    if pointer is None:
        raise LookupError(f"fragment {fragment} has no global value yet")
    target = pointer.version if version is None else version
    if not 0 <= target <= pointer.version:
        raise VersionGone(
            f"version {target} of fragment {fragment} does not exist (the current one is "
            f"{pointer.version})"
        )
    key_name = pointer.value
    if keyframe_version(pointer) > target:
        key_name = await _older_keyframe(tensors, pointer.value, target)
    start = version_of(key_name)
    if cached is not None and start <= cached[0] <= target:
        if cached[0] == target:
            return cached
        start, key_name = cached[0], ""
    entries = await store.log_range(fragment, start, target) if target > start else []
    names = delta_names(entries, start, target)
    try:
        blobs = await asyncio.gather(*(tensors.get(n) for n in names))
        if key_name:
            base = np.frombuffer(await tensors.get(key_name), "<f4")
        else:
            assert cached is not None
            base = cached[1]
    except TensorStoreError as err:  # collected while being read
        raise VersionGone(str(err)) from None
    return target, await asyncio.to_thread(rebuild, base, blobs, codec, block_size)


async def _older_keyframe(tensors: TensorStore, current: str, target: int) -> str:
    """The newest value object at or before `target` in `current`'s folder."""
    folder = current.rpartition("/")[0] + "/"
    by_version: dict[int, list[str]] = {}
    for n in await tensors.names(folder):
        if n.endswith(".value") and version_of(n) <= target:
            by_version.setdefault(version_of(n), []).append(n)
    # A keyframe is written only after its version committed, so one object a version; two at
    # version 0 are initial values of a lost initialization race besides the job's: ambiguous.
    for v in sorted(by_version, reverse=True):
        if len(by_version[v]) == 1:
            return by_version[v][0]
    raise VersionGone(f"no keyframe at or before version {target} is kept in {folder}")


def float32_bytes(value: np.ndarray) -> memoryview:
    """A float32 array's little-endian bytes, without a copy."""
    return np.ascontiguousarray(value, "<f4").view(np.uint8).data


class RebuiltValues:
    """The last value rebuilt of each fragment a replica serves whole, so that fetches of
    successive versions add one delta each rather than a keyframe's worth. Values handed out
    are never changed in place."""

    def __init__(self, codec: codecs.Codec, block_size: int) -> None:
        self.codec, self.block_size = codec, block_size
        self._last: dict[int, tuple[int, np.ndarray]] = {}
        self._locks: dict[int, asyncio.Lock] = {}

    async def get(
        self, store: ControlStore, tensors: TensorStore, fragment: int, version: int | None = None
    ) -> tuple[int, np.ndarray]:
        async with self._locks.setdefault(fragment, asyncio.Lock()):
            cached = self._last.get(fragment)
            found = await value_at(
                store, tensors, fragment, self.codec, self.block_size, version, cached=cached
            )
            if cached is None or found[0] >= cached[0]:
                self._last[fragment] = found
            return found


class Keyframes:
    """A fragment owner's keyframes: those the pointer has named, newest last (two kept),
    one written since that the next commit names, and the write in progress, which the next
    outer step waits for (it changes the arrays being written)."""

    def __init__(
        self, store: ControlStore, fragment: int, epoch: int, tensors: TensorStore
    ) -> None:
        self.store, self.fragment, self.epoch, self.tensors = store, fragment, epoch, tensors
        self.named: list[Keyframe] = []
        self.written: Keyframe | None = None
        self._writing: asyncio.Task[None] | None = None

    def loaded(self, pointer: Pointer) -> None:
        """The keyframe a loaded pointer names is the one kept."""
        self.named = [Keyframe(keyframe_version(pointer), pointer.value, pointer.state)]

    def names(self, version: int, states: int) -> Keyframe:
        """The objects of this owner's keyframe of `version`, with `states` state arrays."""
        job, p, e = self.store.job, self.fragment, self.epoch
        return Keyframe(
            version,
            object_name(job, p, version, e, "value"),
            tuple(object_name(job, p, version, e, f"state{i}") for i in range(states)),
        )

    async def write(self, frame: Keyframe, value: np.ndarray, states: Sequence[np.ndarray]) -> None:
        await asyncio.gather(
            self.tensors.put(frame.value, value),
            *(self.tensors.put(n, a) for n, a in zip(frame.state, states, strict=True)),
        )

    def start(self, version: int, value: np.ndarray, arrays: list[np.ndarray]) -> None:
        """Write this version's value, state and residual in the background; the next
        commit names them once written."""
        frame = self.names(version, len(arrays))

        async def write() -> None:
            started = time.monotonic()
            try:
                await self.write(frame, value, arrays)
            except Exception as err:  # the pointer keeps the older keyframe; deltas cover it
                log.warning(
                    "keyframe_failed", fragment=self.fragment, version=version, error=repr(err)
                )
                # What was written is collected later if the store refuses now: a merge
                # waits for this task, and must not fail with it.
                with contextlib.suppress(Exception):
                    await self.tensors.delete([frame.value, *frame.state])
                return
            self.written = frame
            log.info(
                "keyframe_written",
                fragment=self.fragment,
                version=version,
                seconds=round(time.monotonic() - started, 4),
            )

        self._writing = asyncio.create_task(write())

    async def wait(self) -> None:
        """Wait for a keyframe write in progress: it reads the arrays the step changes."""
        if self._writing is not None:
            await asyncio.shield(self._writing)
            self._writing = None

    def newest(self) -> Keyframe:
        """The keyframe the next commit names: the newest written."""
        return self.written or self.named[-1]

    def committed(self, frame: Keyframe) -> None:
        """A commit named `frame`: it is the newest kept, beside the one before."""
        if frame is not self.named[-1]:
            self.named = [self.named[-1], frame]
        self.written = None

    def close(self) -> None:
        if self._writing is not None:
            self._writing.cancel()
