"""The global values a learner holds, as the synchronizer holds them, and their assembly.

Owns the newest value held per fragment (deltas apply onto it, services/downlink.py), the
newest version known per fragment, and the two queues the engine reads: new global values
(`fragments`) and, for a learner of several processes, notices of new versions (`notices`).
Every Follow call's thread, a fetch and the session thread hand values on: under its lock.
No gRPC here.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import numpy as np
import xxhash

from services import codec as codecs
from services.codec import Segment
from services.downlink import apply_segment
from services.gen.atoll.v1 import fragment_pb2


@dataclass(frozen=True)
class GlobalFragment:
    fragment: int
    version: int
    values: np.ndarray


@dataclass(frozen=True)
class RangeValues:
    """Some value ranges of a fragment at one version, back to back in range order;
    `checksum`: the whole value's, as the commit log records it."""

    fragment: int
    version: int
    values: np.ndarray
    checksum: int


class Assembly:
    """One global value coming in chunk by chunk: each chunk lands in place as it arrives."""

    def __init__(self, chunk: fragment_pb2.GlobalFragmentChunk, base: np.ndarray | None) -> None:
        self.header = chunk.header
        self.version, self.delta, self.base = chunk.version, chunk.delta, base
        self.values = np.empty(chunk.header.num_elements, np.float32)
        self.next = 0
        self.hasher = xxhash.xxh3_64()
        self.codec = codecs.by_wire(chunk.header.codec)

    def feed(self, chunk: fragment_pb2.GlobalFragmentChunk) -> bool:
        """Add one chunk; True once the value is whole and checked."""
        if chunk.chunk_index != self.next or chunk.header != self.header:
            raise ValueError("global fragment chunks out of order")
        segment = Segment(int(chunk.value_offset), int(chunk.value_count), chunk.data)
        if segment.offset + segment.count > self.values.size:
            raise ValueError("global fragment chunk beyond the fragment")
        if self.delta:
            assert self.base is not None
            apply_segment(self.base, self.values, segment, self.codec, self.header.block_size)
        else:
            end = segment.offset + segment.count
            self.values[segment.offset : end] = self.codec.decode(
                segment.data, segment.count, self.header.block_size
            )
        self.hasher.update(chunk.data)
        self.next += 1
        if self.next < self.header.chunk_count:
            return False
        if self.hasher.intdigest() != self.header.checksum:
            raise ValueError("global fragment checksum mismatch")
        return True


class Held:
    """The values and versions a learner holds, and what it hands on to the engine."""

    def __init__(self) -> None:
        # The newest global value held per fragment, exactly as the synchronizer holds it.
        self.values: dict[int, tuple[int, np.ndarray]] = {}
        self.known_versions: dict[int, int] = {}
        self.fragments: queue.Queue[GlobalFragment] = queue.Queue()
        self.notices: queue.Queue[tuple[int, int]] = queue.Queue()  # (fragment, version)
        self._lock = threading.RLock()

    def get(self, p: int) -> tuple[int, np.ndarray] | None:
        """Fragment p's value held, with its version."""
        with self._lock:
            return self.values.get(p)

    def versions(self) -> dict[int, int]:
        """The version of each value held."""
        with self._lock:
            return {p: v for p, (v, _) in self.values.items()}

    def hold(self, got: GlobalFragment) -> None:
        with self._lock:
            held = self.values.get(got.fragment)
            if held is None or got.version > held[0]:
                self.values[got.fragment] = (got.version, got.values)

    def know(self, fragments: list[GlobalFragment]) -> None:
        """Values the caller adopts itself (fetched): their versions count as known."""
        with self._lock:
            for g in fragments:
                self.known_versions[g.fragment] = max(
                    self.known_versions.get(g.fragment, -1), g.version
                )

    def deliver(self, got: GlobalFragment) -> None:
        """Hand a new value on to the engine, unless its version is known already."""
        with self._lock:
            if got.version <= self.known_versions.get(got.fragment, -1):
                return
            self.known_versions[got.fragment] = got.version
            self.fragments.put(got)

    def notice(self, fragment: int, version: int) -> None:
        """Hand a new version on (to a learner of several processes, which fetches it)."""
        with self._lock:
            if version > self.known_versions.get(fragment, -1):
                self.known_versions[fragment] = version
                self.notices.put((fragment, version))

    def moved(self, versions: list[int]) -> list[int]:
        """The fragments whose current version (`versions`) is newer than any known."""
        with self._lock:
            return [p for p, v in enumerate(versions) if v > self.known_versions.get(p, -1)]
