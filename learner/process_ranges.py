"""The fragment I/O of one process of a learner that spans several processes (hosts).

Parameters are global arrays sharded over every process's devices (learner/mesh.py); each
process keeps, per fragment, only the values its devices hold (its *vector*,
learner/shards.py) as anchor, error feedback and adopted global values, and sends and
receives only those: its part of each update (one Ingest call, `UpdateChunk.part`), and its
ranges of each new global value (a range fetch at the version the leader names). Sharded
(`--param-layout sharded`), no process ever holds a whole fragment; replicated, every
process holds and fetches each whole, and the first alone sends it (the others' updates are
empty, settled by the leader's acks). Its news come at the ticks the leader publishes
(learner/ticks.py), so every process adopts the same versions at the same step.

Bandwidth down: float32 values of a process's own ranges, 4 bytes a value per version,
against the about 1 byte a value of the int8 deltas a learner of one process receives for
whole fragments.

Not yet: local checkpoints (a restart resumes its read position only), radial merging (the
owner needs whole-tensor norms before the values: the job must use `--merge mean`).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import structlog

from learner.client import RangeValues
from learner.fragment_io import Joined, Link, Outgoing
from learner.group import Group
from learner.outer import OuterState, Send
from learner.shards import FragmentShard, plan
from learner.ticks import FETCH_TIMEOUT_S, Ticks
from learner.workload import FlatParams
from services import codec as codecs
from services.codec import ErrorFeedback, Segment, encode_segments
from services.config import INIT_CLAIM_S
from services.gen.atoll.v1 import fragment_pb2, session_pb2
from services.grpcopts import backoff_delays
from services.layout import FragmentLayout, fragment_layout

log = structlog.get_logger("atoll.learner")
OWNERS_WAIT_S = 30.0  # how long a joining leader waits for every fragment to have an owner
INIT_SEND_S = 60.0  # how long the initial values may take to be acknowledged


@dataclass
class PartFeedback(ErrorFeedback):
    """Error feedback over the values this process sends of a fragment: its vector's runs
    `runs` ((vector offset, count)), each encoded on its own and sent at its fragment
    offset (`offsets`), so no chunk spans values of another process."""

    runs: tuple[tuple[int, int], ...] = ()
    offsets: tuple[int, ...] = ()

    def encode(self, delta: np.ndarray) -> list[Segment]:
        picked = _pick(delta, self.runs)
        corrected = picked if self.residual is None else picked + self.residual
        segments, decoded = _encode_runs(
            self.codec, corrected, self.runs, self.offsets, self.block_size, self.chunk_bytes
        )
        self.residual = corrected - decoded
        return segments


class ProcessRanges:
    """`FragmentIO` (learner/fragment_io.py) for one process of several."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.version_notices = True
        self.speaks = group.leader  # the leader's session speaks for the learner
        # The loop stops when the leader says so (a stop asked of the leader, the job's
        # budget), never on a signal one process got alone.
        self.stopping = threading.Event()
        self.tape_fields = {"process": group.process}
        self.shards: list[FragmentShard] = []
        self._shardings: dict[str, jax.sharding.Sharding] = {}
        self._seqs = itertools.count(1)  # every process numbers the same updates alike
        self._checksums: dict[tuple[int, int], int] = {}  # (fragment, version) -> checksum

    def incarnation(self, mine: str) -> str:
        """One incarnation for the learner: the leader's."""
        if self.group.leader:
            self.group.publish("incarnation", mine)
            return mine
        theirs: str = self.group.read("incarnation")
        return theirs

    # --- joining --------------------------------------------------------------------------
    def join(self, link: Link, initial: Any, sharding: Any) -> Joined:
        """Join the job (the leader's session; every process its own data path) and return
        its global parameters, each process making and fetching only its own shards."""
        if sharding is None:
            raise ValueError("a learner of several processes needs its parameters' shardings")
        self.link, client, group = link, link.client, self.group
        structlog.contextvars.bind_contextvars(process=group.process)
        self.ticks = Ticks(group, client, link.stop_requested, self.stopping)
        if not isinstance(sharding, jax.sharding.Sharding):
            self._shardings = dict(link.named.flatten(sharding))  # type: ignore[arg-type]
        else:
            self._shardings = dict.fromkeys(link.named.names, sharding)
        if group.leader:
            welcome = client.connect()
            group.publish("welcome", welcome.SerializeToString().hex())
            self.ticks.owners_told = self._await_owners(welcome.config.fragments)
            owners = session_pb2.OwnerMap(owners=self.ticks.owners_told)
            group.publish("owners", owners.SerializeToString().hex())
        else:
            welcome = session_pb2.Welcome.FromString(bytes.fromhex(group.read("welcome")))
            client.connect_data()
            owners = session_pb2.OwnerMap.FromString(bytes.fromhex(group.read("owners")))
            client.set_owners(owners.owners)
        cfg = self.config = welcome.config
        codec = codecs.by_wire(cfg.codec)
        self.layout: FragmentLayout = fragment_layout(link.specs, cfg.fragments)
        indices = {s.name: self._shardings[s.name].devices_indices_map(s.shape) for s in link.specs}
        self.shards = plan(self.layout, indices, group.process)
        if group.leader and any(not s.sent for s in self.shards):
            raise RuntimeError("the leader must send a part of every fragment; check the mesh")
        if self._initial_decision(welcome) == "initialize":
            self._send_initial(initial)
        values = self._fetch_joined()
        self.outer = OuterState.start(
            list(values), codec, cfg.block_size, keep_progress=cfg.keep_overlap_progress
        )
        for shard, f in zip(self.shards, self.outer.fragments, strict=True):
            f.feedback = PartFeedback(
                codec,
                cfg.block_size,
                runs=shard.sent_local,
                offsets=tuple(offset for offset, _ in shard.sent),
            )
        self.ticks.follow(self._fetch_version)
        flat = {
            leaf.name: self._leaf(p, leaf.name, vector)
            for p, (_, vector) in enumerate(values)
            for leaf in self.layout.fragments[p].leaves
        }
        log.info(
            "joined",
            learner=link.settings.id,
            process=group.process,
            processes=group.count,
            incarnation=client.incarnation,
            fragments=cfg.fragments,
            held=[s.length for s in self.shards],
            versions=[v for v, _ in values],
        )
        return Joined(cfg, self.outer, link.named.unflatten(flat))

    def _await_owners(self, fragments: int) -> list[session_pb2.FragmentOwner]:
        """The owner map once every fragment has an owner (the other processes send to them
        before the first tick hands the map on)."""
        client = self.link.client
        deadline = time.monotonic() + OWNERS_WAIT_S
        while len(client.owners) < fragments and time.monotonic() < deadline:
            client.check()
            time.sleep(0.05)
        return sorted(client.owners.values(), key=lambda o: o.fragment)

    def _initial_decision(self, welcome: session_pb2.Welcome) -> str:
        """Whether this learner sends the job's initial values: the leader decides."""
        if not self.group.leader:
            decided: str = self.group.read("initial")
            return decided
        decision = "fetch"
        if not welcome.initialized:
            decision = "initialize" if welcome.initializer else self._await_initialized()
        self.group.publish("initial", decision)
        return decision

    def _await_initialized(self) -> str:
        """Wait for the learner holding the claim to send the initial values; 'initialize'
        if they did not come while its claim lasted."""
        deadline = time.monotonic() + INIT_CLAIM_S + 5.0
        while time.monotonic() < deadline and not self.link.stop_requested.is_set():
            try:
                self.link.client.fetch_ranges({0: [(0, 1)]})
                return "fetch"
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
            time.sleep(0.2)
        log.warning("initial_parameters_late", learner=self.link.settings.id)
        return "initialize"

    def _send_initial(self, initial: Any) -> None:
        """Every process makes its own shards of the initial values (one compiled function
        with the parameters' shardings) and sends its part of each fragment."""
        client = self.link.client
        shardings = self.link.named.unflatten(self._shardings)  # type: ignore[arg-type]
        made = jax.jit(initial if callable(initial) else lambda: initial, out_shardings=shardings)
        flat = self.link.named.flatten(made())
        for p, shard in enumerate(self.shards):
            seq = next(self._seqs)  # drawn by every process, so all number updates alike
            if not shard.sent:  # another process sends all of it (its leaves replicated):
                continue  # an empty part would wait for an acknowledgement never sent
            vector = self._host(p, self._shard_arrays(p, flat))
            segments, _ = _encode_runs(
                codecs.by_name("fp32"),
                _pick(vector, shard.sent_local),
                shard.sent_local,
                tuple(o for o, _ in shard.sent),
                0,
                codecs.DEFAULT_MAX_CHUNK_BYTES,
            )
            client.send_update(
                fragment=p,
                payload=segments,
                codec=fragment_pb2.CODEC_FP32,
                block_size=0,
                num_elements=shard.size,
                kind=session_pb2.UPDATE_KIND_INITIAL,
                seq=seq,
                part=shard.part,
                parts=shard.parts if shard.parts > 1 else 0,
            )
        deadline = time.monotonic() + INIT_SEND_S
        while client.unacked() and time.monotonic() < deadline:
            client.check()
            time.sleep(0.05)

    def _fetch_joined(self) -> list[tuple[int, np.ndarray]]:
        """Every fragment's global value at one version for all processes: the leader
        fetches the current ones and names their versions; the others fetch those."""
        client = self.link.client
        wanted = {p: list(s.held) for p, s in enumerate(self.shards)}
        if self.group.leader:
            got = client.fetch_ranges(wanted)
            self.group.publish("joined", [g.version for g in got])
        else:
            versions = self.group.read("joined")
            got = client.fetch_ranges(wanted, dict(enumerate(versions)))
        got.sort(key=lambda g: g.fragment)
        for g in got:
            self._checksums[(g.fragment, g.version)] = g.checksum
            client.known_versions[g.fragment] = g.version
        return [(g.version, g.values) for g in got]

    def _fetch_version(self, p: int, version: int, closed: threading.Event) -> RangeValues:
        """This process's ranges of fragment p at `version` (the versions thread)."""
        delays = backoff_delays(max_s=self.link.settings.max_backoff_s, initial_s=0.1)
        deadline = time.monotonic() + FETCH_TIMEOUT_S
        wanted = {p: list(self.shards[p].held)}
        while True:
            try:
                return self.link.client.fetch_ranges(wanted, {p: version})[0]
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"fragment {p} version {version}: this process could not fetch its "
                        f"values ({err.code()}); the learner must restart"
                    ) from None
                log.info("version_fetch_retry", fragment=p, version=version, code=str(err.code()))
                closed.wait(next(delays))

    # --- news: at the leader's ticks ------------------------------------------------------
    def news(self, flat: FlatParams, *, wait: float, halt: bool) -> tuple[bool, bool]:
        verdict = self.ticks.tick(wait=wait, halt=halt)
        adopted = False
        for event in verdict.events:
            self._checksums[(event.fragment, event.version)] = event.checksum
            f = self.outer.fragments[event.fragment]
            if f.receive(event.values, event.version):
                self.adopt(flat, event.fragment, event.values, event.version)
                adopted = True
        return adopted, verdict.halt

    def final_ack(self, seq: int) -> session_pb2.Ack | None:
        return self.ticks.final.get(seq)

    def job_finished(self) -> bool:
        return self.ticks.finished

    # --- values ---------------------------------------------------------------------------
    def take(self, p: int, send: Send, flat: FlatParams) -> Outgoing:
        """This process's part of fragment p's update (every process takes it at the same
        step, under the same seq)."""
        f, shard = self.outer.fragments[p], self.shards[p]
        # A device-side copy: the loop's step may donate the parameters' buffers.
        snapshot = [jnp.copy(x) for x in self._shard_arrays(p, flat)]
        return Outgoing(
            lambda: f.encode(send, self._host(p, snapshot)),
            shard.size,
            seq=next(self._seqs),
            part=shard.part,
            parts=shard.parts if shard.parts > 1 else 0,
        )

    def adopt(self, flat: FlatParams, p: int, value: np.ndarray, version: int) -> None:
        f = self.outer.fragments[p]
        alpha = self.config.merge_alpha
        needs_local = alpha or (f.keep_progress and f.sent_theta is not None)
        theta = self._host(p, self._shard_arrays(p, flat)) if needs_local else value
        merged = f.local_value(theta, value, alpha)
        f.adopt(value, version)
        for leaf in self.layout.fragments[p].leaves:
            flat[leaf.name] = self._leaf(p, leaf.name, merged)

    def refetch(self, flat: FlatParams, fragments: set[int]) -> set[int]:
        """A refused update's fragment continues from the newest global value every process
        already holds (versions reach all of them alike): nothing to fetch."""
        for p in sorted(fragments):
            f = self.outer.fragments[p]
            newer = f.latest is not None and f.latest_version > f.version
            self.adopt(flat, p, f.latest if newer else f.base, max(f.version, f.latest_version))  # type: ignore[arg-type]
        return set()

    def global_params(self, sharding: Any) -> Any:
        flat = {}
        for p, f in enumerate(self.outer.fragments):
            newer = f.latest is not None and f.latest_version > f.version
            vector = f.latest if newer else f.base
            for leaf in self.layout.fragments[p].leaves:
                flat[leaf.name] = self._leaf(p, leaf.name, vector)  # type: ignore[arg-type]
        return self.link.named.unflatten(flat)

    def checksums(self, flat: FlatParams) -> list[int]:
        """Each fragment's checksum is that of the global value it ends on (every process
        adopted it for its own values), since no process holds a whole fragment to hash."""
        return [
            self._checksums.get((p, max(f.version, f.latest_version)), 0)
            for p, f in enumerate(self.outer.fragments)
        ]

    def report(self) -> dict[str, Any]:
        return {
            "shards": {  # this process's values of each fragment: held, and sent
                "process": self.group.process,
                "held": [s.length for s in self.shards],
                "sent": [sum(c for _, c in s.sent) for s in self.shards],
            },
        }

    def close(self) -> None:
        if hasattr(self, "ticks"):  # joined
            self.ticks.close()

    # --- this process's shards ------------------------------------------------------------
    def _shard_arrays(self, p: int, flat: FlatParams) -> list[jax.Array]:
        """The device arrays of fragment p's pieces on this process, in piece order."""
        out = []
        for piece in self.shards[p].pieces:
            on = {s.device: s.data for s in flat[piece.leaf].addressable_shards}
            out.append(on[piece.devices[0]])
        return out

    def _host(self, p: int, arrays: list[jax.Array]) -> np.ndarray:
        """This process's vector of fragment p from its pieces' device arrays."""
        shard = self.shards[p]
        vector = np.empty(shard.length, np.float32)
        for piece, data in zip(shard.pieces, jax.device_get(arrays), strict=True):
            values = np.asarray(data, np.float32).reshape(-1)
            at = 0
            for offset, count in piece.spans:
                vector[offset : offset + count] = values[at : at + count]
                at += count
        return vector

    def _leaf(self, p: int, name: str, vector: np.ndarray) -> jax.Array:
        """Leaf `name` of fragment p as a global array, this process's shards from its
        vector."""
        spec = next(s for s in self.layout.fragments[p].leaves if s.name == name)
        arrays = []
        for piece in self.shards[p].pieces:
            if piece.leaf != name:
                continue
            data = np.concatenate([vector[o : o + c] for o, c in piece.spans]).reshape(piece.shape)
            arrays += [jax.device_put(data, d) for d in piece.devices]
        return jax.make_array_from_single_device_arrays(spec.shape, self._shardings[name], arrays)


def _pick(vector: np.ndarray, runs: tuple[tuple[int, int], ...]) -> np.ndarray:
    if not runs:
        return np.zeros(0, np.float32)
    return np.concatenate([vector[o : o + c] for o, c in runs]).astype(np.float32, copy=False)


def _encode_runs(
    codec: codecs.Codec,
    values: np.ndarray,
    runs: tuple[tuple[int, int], ...],
    offsets: tuple[int, ...],
    block_size: int,
    chunk_bytes: int,
) -> tuple[list[Segment], np.ndarray]:
    """`values` (the runs back to back) encoded run by run, each segment at its fragment
    offset; and what they decode to."""
    segments: list[Segment] = []
    decoded = np.empty_like(values)
    at = 0
    for (_, count), offset in zip(runs, offsets, strict=True):
        part, back = encode_segments(codec, values[at : at + count], block_size, chunk_bytes)
        segments += [Segment(offset + s.offset, s.count, s.data) for s in part]
        decoded[at : at + count] = back
        at += count
    return segments, decoded
