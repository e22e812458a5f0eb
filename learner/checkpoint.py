"""A learner slot's local checkpoint: what a restarted learner goes on from.

Without it, a learner killed between two syncs loses every step since each fragment's last
send. With it (`--state-dir`), the slot writes, every `--checkpoint-every` steps (default:
every step, at most one per `--checkpoint-seconds`, and none while the last is still being
written), its parameters, its inner optimizer state, each fragment's outer bookkeeping
(anchor, version, counters, error-feedback residual, the update in flight) and its place in
the data. A new incarnation of the slot restores it after joining, so only the steps since
the last checkpoint are lost.

Storage: two files written in turn, each overwritten in place (a safetensors body behind a
small header with a sequence number and the body's checksum, the header written last). A
kill mid-write leaves that file's checksum wrong and the other file whole; overwriting in
place reuses the file's blocks and cached pages, where writing a new file and renaming it
over the old one allocated and discarded a whole checkpoint's worth each second.

The body is written array by array straight from the host copies, hashed as it goes, and
read back into one buffer the arrays are views of: a checkpoint never exists twice in
memory. Every write and read loops until all its bytes are through: Linux moves at most
0x7ffff000 bytes in one call, and a single unchecked call once cut bodies at 2 GiB.

On rejoining, every restored fragment moves onto the job's current value, keeping the
progress made since its anchor (`FragmentState.carry_onto`), so the learner trains the
current model and its next update is not stale. An update the dead incarnation had in
flight is not sent again (its id belonged to it): if the synchronizer had accepted it, it is
merged; if not, its steps are lost; either way the local fragment keeps only the progress
made after it was taken.
"""

from __future__ import annotations

import copy
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import xxhash

from learner.outer import FragmentState

FORMAT = 2
MAGIC = b"atollck2"
HEADER = struct.Struct("<8sQQQ")  # magic, sequence, body length, checksum of the body
# safetensors' names of the dtypes a checkpoint may hold
DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(t)
    for name, t in (
        ("F64", np.float64),
        ("F32", np.float32),
        ("F16", np.float16),
        ("BF16", ml_dtypes.bfloat16),
        ("I64", np.int64),
        ("I32", np.int32),
        ("I16", np.int16),
        ("I8", np.int8),
        ("U64", np.uint64),
        ("U32", np.uint32),
        ("U16", np.uint16),
        ("U8", np.uint8),
        ("BOOL", np.bool_),
    )
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass
class Snapshot:
    """Host copies of everything a checkpoint holds: the writer thread makes them from
    device-side copies taken between two steps."""

    meta: dict[str, Any]
    params: dict[str, np.ndarray]
    opt_leaves: list[np.ndarray]
    fragments: list[dict[str, Any]]
    arrays: dict[str, np.ndarray]


def fragment_record(p: int, f: FragmentState, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """One fragment's bookkeeping as the training thread owns it; its anchor goes into
    `arrays`. (What the encoder thread owns comes from `encoder_held`.)"""
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


@dataclass(frozen=True)
class EncoderHeld:
    """What the encoder thread owns of one fragment, as it stood after the sends queued
    before a checkpoint: references only (each is replaced, never changed in place, by the
    next encoding), so taking them costs nothing and the copies happen on the writer."""

    sent_theta: Any  # the fragment the in-flight update took, or None
    feedback: Any  # a shallow copy of the error feedback (its residual as it was)


def encoder_held(f: FragmentState, in_flight: bool) -> EncoderHeld:
    """Run on the encoder thread, after the sends queued before the snapshot."""
    sent = f.sent_theta if in_flight else None
    return EncoderHeld(sent_theta=sent, feedback=copy.copy(f.feedback))


def encoder_arrays(p: int, held: EncoderHeld, arrays: dict[str, np.ndarray]) -> None:
    """The residual, and the fragment the in-flight update took, copied to the host (from
    the device, where they stay when updates are encoded there) into `arrays`."""
    if held.sent_theta is not None:
        arrays[f"frag{p}/sent_theta"] = np.asarray(held.sent_theta, np.float32)
    residual = held.feedback.residual
    if residual is not None:
        arrays[f"frag{p}/residual"] = residual


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


@dataclass
class Loaded:
    meta: dict[str, Any]
    params: dict[str, np.ndarray]
    opt_leaves: list[np.ndarray]
    arrays: dict[str, np.ndarray]

    @property
    def fragments(self) -> list[dict[str, Any]]:
        return list(self.meta["fragment_states"])


class Slots:
    """A slot's checkpoint files: `<stem>.0` and `<stem>.1`, written in turn."""

    def __init__(self, stem: Path) -> None:
        self.paths = (stem.with_name(stem.name + ".0"), stem.with_name(stem.name + ".1"))
        self._sequence: int | None = None  # of the newest whole checkpoint

    def read(self) -> Loaded | None:
        """The newest whole checkpoint, or None if there is none."""
        newest: tuple[int, bytearray] | None = None
        for path in self.paths:
            found = _body(path)
            if found is not None and (newest is None or found[0] > newest[0]):
                newest = found
        self._sequence = 0 if newest is None else newest[0]
        return None if newest is None else _parse(newest[1])

    def write(self, snap: Snapshot) -> None:
        """Overwrite the older file (never the newest whole one) with this checkpoint."""
        if self._sequence is None:
            self.read()
        assert self._sequence is not None
        sequence = self._sequence + 1
        arrays = dict(snap.arrays)
        arrays.update({f"param/{k}": v for k, v in snap.params.items()})
        arrays.update({f"opt/{i}": np.asarray(v) for i, v in enumerate(snap.opt_leaves)})
        meta = {**snap.meta, "format": FORMAT, "fragment_states": snap.fragments}
        pieces = _safetensors(arrays, {"atoll": json.dumps(meta)})
        path = self.paths[sequence % 2]
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            digest = xxhash.xxh3_64()  # services.codec.checksum's hash, fed piece by piece
            offset = HEADER.size
            for piece in pieces:
                digest.update(piece)
                write_all(fd, piece, offset)
                offset += len(piece)
            length = offset - HEADER.size
            if os.fstat(fd).st_size > offset:
                os.ftruncate(fd, offset)
            write_all(fd, HEADER.pack(MAGIC, sequence, length, digest.intdigest()), 0)
        finally:
            os.close(fd)
        self._sequence = sequence


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of `data` at `offset`: one call writes at most 0x7ffff000 bytes on Linux
    (fewer on a full disk or a signal), so go on from where each call stopped."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        written = os.pwrite(fd, view[done:], offset + done)
        if written <= 0:
            raise OSError(f"wrote nothing at byte {offset + done} of a checkpoint")
        done += written


def read_into(fd: int, buffer: bytearray | memoryview, offset: int) -> bool:
    """Fill `buffer` from `offset`; False if the file ends first."""
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            return False
        done += got
    return True


def _safetensors(arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> list[memoryview]:
    """A safetensors file as pieces to write in turn: its header, then each array's bytes
    (views of the arrays, not copies)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    pieces: list[memoryview] = []
    end = 0
    for name, value in arrays.items():
        a = np.asarray(value)
        if a.dtype not in _DTYPE_NAMES:
            raise TypeError(f"a checkpoint cannot hold {name!r} of dtype {a.dtype}")
        header[name] = {
            "dtype": _DTYPE_NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [end, end + a.nbytes],
        }
        end += a.nbytes
        pieces.append(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the arrays start 8-byte aligned
    return [memoryview(len(text).to_bytes(8, "little") + text), *pieces]


def _body(path: Path) -> tuple[int, bytearray] | None:
    """(sequence, body) of a whole checkpoint file; None if missing, torn or foreign."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        head = bytearray(HEADER.size)
        if not read_into(fd, head, 0):
            return None
        magic, sequence, length, expect = HEADER.unpack(head)
        if magic != MAGIC or HEADER.size + length > os.fstat(fd).st_size:
            return None
        body = bytearray(length)
        if not read_into(fd, body, HEADER.size):
            return None
    except OSError:
        return None
    finally:
        os.close(fd)
    if xxhash.xxh3_64_intdigest(body) != expect:
        return None
    return int(sequence), body


def _arrays(body: bytearray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The metadata and arrays of a safetensors file; the arrays are views of `body`."""
    header_len = int.from_bytes(body[:8], "little")
    header = json.loads(bytes(body[8 : 8 + header_len]))
    start = 8 + header_len
    arrays = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize or start + end > len(body):
            raise ValueError(f"{name!r}: its offsets disagree with its shape")
        arrays[name] = np.frombuffer(body, dtype, count, start + begin).reshape(shape)
    return dict(header.get("__metadata__", {})), arrays


def _parse(body: bytearray) -> Loaded | None:
    try:
        metadata, arrays = _arrays(body)
        meta = json.loads(metadata["atoll"])
    except (ValueError, KeyError, TypeError):
        return None
    if meta.get("format") != FORMAT:
        return None
    params = {k.removeprefix("param/"): v for k, v in arrays.items() if k.startswith("param/")}
    opt = sorted(
        ((int(k.removeprefix("opt/")), v) for k, v in arrays.items() if k.startswith("opt/")),
        key=lambda kv: kv[0],
    )
    # Copies: the fragments' arrays live on in the learner, and a view would keep the
    # whole body alive with them.
    rest = {k: v.copy() for k, v in arrays.items() if k.startswith("frag")}
    return Loaded(meta, params, [v for _, v in opt], rest)


def matches(loaded: Loaded, expect: dict[str, Any], names: Sequence[str]) -> str | None:
    """Why this checkpoint cannot be used for this job and model (None: it can)."""
    for key, value in expect.items():
        if loaded.meta.get(key) != value:
            return f"{key} is {loaded.meta.get(key)!r} in the checkpoint, {value!r} now"
    if sorted(loaded.params) != sorted(names):
        return "the model's parameters differ"
    return None
