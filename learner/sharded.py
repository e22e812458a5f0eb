"""The sync engine of one process of a learner that spans several processes (hosts).

Parameters are global arrays sharded over every process's devices (learner/mesh.py); each
process keeps, per fragment, only the values its devices hold (its *vector*,
learner/shards.py) as anchor, error feedback and adopted global values, and sends and
receives only those: its part of each update (one Ingest call, `UpdateChunk.part`), and its
ranges of each new global value (a range fetch at the version the leader names). No process
ever holds a whole fragment.

Process 0, the leader, keeps the learner's control session (hello, heartbeats, the one live
session per slot), asking to be told new versions rather than sent their values. Between two
steps every process takes a *tick* (learner/group.py): the leader publishes what it knows
(how many new versions every process is to adopt, the final acks, the owner map, whether the
job is finished, whether to stop, whether to stop waiting) and every process, the leader
included, applies exactly that. The bookkeeping of `learner.outer` is deterministic, so
every process makes the same decisions (what is due, what is in flight, which seq an update
has) on its own values.

Versions: the leader hands on each version it is told of as an event; every process fetches
its ranges of it in the background as soon as it is published, and adopts it at the tick
that names it (waiting there only if its own fetch is not in yet). Bandwidth down: float32
values of a process's own ranges, 4 bytes a value per version, against the about 1 byte a
value of the int8 deltas a learner of one process receives for whole fragments.

Not yet: local checkpoints (a restart resumes its read position only), radial merging (the
owner needs whole-tensor norms before the values: the job must use `--merge mean`).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import structlog

from learner.client import RangeValues
from learner.group import Group
from learner.outer import OuterState
from learner.settings import LearnerSettings
from learner.shards import FragmentShard, plan
from learner.sync import FINAL_SYNC_TIMEOUT_S, SyncEngine
from services import codec as codecs
from services.codec import ErrorFeedback, Segment, encode_segments
from services.config import INIT_CLAIM_S
from services.gen.atoll.v1 import fragment_pb2, session_pb2
from services.grpcopts import backoff_delays
from services.layout import fragment_layout
from services.tape import Tape

log = structlog.get_logger("atoll.learner")
TICK_WAIT_S = 0.05  # a waiting leader publishes a tick at least this often
# Ticks are kept in blocks of this many; the block before the last is dropped as a new one
# starts (the processes' steps keep them within a step or two of each other).
TICKS_KEPT = 1000
FETCH_TIMEOUT_S = 300.0  # a process whose fetch of a named version has not come gives up


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


class ShardedSyncEngine(SyncEngine):
    """`SyncEngine` for one process of several: same calls, same hook, same decisions."""

    def __init__(
        self,
        settings: LearnerSettings,
        shapes: Any,
        group: Group,
        *,
        tokens_per_step: int,
        tape: Tape | None = None,
        stop_requested: threading.Event | None = None,
    ) -> None:
        super().__init__(
            settings,
            shapes,
            tokens_per_step=tokens_per_step,
            tape=tape,
            stop_requested=stop_requested,
        )
        self.group = group
        # The loop stops when the leader says so (a stop asked of the leader, the job's
        # budget), never on a signal one process got alone.
        self.stopping = threading.Event()
        # One incarnation for the learner: the leader's.
        if group.leader:
            group.publish("incarnation", self.incarnation)
        else:
            self.incarnation = group.read("incarnation")
        self.client.incarnation = self.incarnation
        self.client.version_notices = True
        structlog.contextvars.bind_contextvars(
            incarnation=self.incarnation, process=self.group.process
        )
        self._seqs = itertools.count(1)
        self._ticks = itertools.count()
        self._final: dict[int, session_pb2.Ack] = {}
        self._relayed: set[int] = set()
        self._owners_told: list[session_pb2.FragmentOwner] = []
        self._finished = False
        self._applied = 0  # events adopted
        self._events: dict[int, RangeValues] = {}  # fetched, not adopted yet
        self._fetched = threading.Condition()
        self._failed: BaseException | None = None
        self._checksums: dict[tuple[int, int], int] = {}  # (fragment, version) -> checksum
        self._closed = threading.Event()
        self._shardings: dict[str, jax.sharding.Sharding] = {}
        self.shards: list[FragmentShard] = []

    # --- joining --------------------------------------------------------------------------
    def join(self, initial: Any | Callable[[], Any], sharding: Any = None) -> Any:
        """Join the job (the leader's session; every process its own data path) and return
        its global parameters, each process making and fetching only its own shards."""
        if sharding is None:
            raise ValueError("a learner of several processes needs its parameters' shardings")
        if not isinstance(sharding, jax.sharding.Sharding):
            self._shardings = dict(self.named.flatten(sharding))  # type: ignore[arg-type]
        else:
            self._shardings = dict.fromkeys(self.named.names, sharding)
        if self.group.leader:
            welcome = self.client.connect()
            self.group.publish("welcome", welcome.SerializeToString().hex())
            self._owners_told = self._await_owners(welcome.config.fragments)
            owners = session_pb2.OwnerMap(owners=self._owners_told)
            self.group.publish("owners", owners.SerializeToString().hex())
        else:
            welcome = session_pb2.Welcome.FromString(bytes.fromhex(self.group.read("welcome")))
            self.client.connect_data()
            owners = session_pb2.OwnerMap.FromString(bytes.fromhex(self.group.read("owners")))
            self.client.set_owners(owners.owners)
        cfg = welcome.config
        self.mode, self.alpha = cfg.mode, cfg.merge_alpha
        self.fragments, self.inner_steps = cfg.fragments, cfg.inner_steps
        self.codec = codecs.by_wire(cfg.codec)
        self.block_size = cfg.block_size
        self.layout = fragment_layout(self.specs, self.fragments)
        indices = {s.name: self._shardings[s.name].devices_indices_map(s.shape) for s in self.specs}
        self.shards = plan(self.layout, indices, self.group.process)
        if self.group.leader and any(not s.sent for s in self.shards):
            raise RuntimeError("the leader must send a part of every fragment; check the mesh")
        decision = self._initial_decision(welcome)
        if decision == "initialize":
            self._send_initial(initial)
        values = self._fetch_joined()
        self.outer = OuterState.start(
            [(version, vector) for version, vector in values],
            self.codec,
            self.block_size,
            keep_progress=cfg.keep_overlap_progress,
        )
        for shard, f in zip(self.shards, self.outer.fragments, strict=True):
            f.feedback = PartFeedback(
                self.codec,
                self.block_size,
                runs=shard.sent_local,
                offsets=tuple(offset for offset, _ in shard.sent),
            )
        threading.Thread(target=self._follow_versions, name="atoll-versions", daemon=True).start()
        flat = {
            leaf.name: self._leaf(p, leaf.name, vector)
            for p, (_, vector) in enumerate(values)
            for leaf in self.layout.fragments[p].leaves
        }
        log.info(
            "joined",
            learner=self.settings.id,
            process=self.group.process,
            processes=self.group.count,
            incarnation=self.incarnation,
            fragments=self.fragments,
            held=[s.length for s in self.shards],
            versions=[v for v, _ in values],
        )
        return self.named.unflatten(flat)

    def _await_owners(self, fragments: int) -> list[session_pb2.FragmentOwner]:
        """The owner map once every fragment has an owner (the other processes send to them
        before the first tick hands the map on)."""
        deadline = time.monotonic() + 30
        while len(self.client.owners) < fragments and time.monotonic() < deadline:
            self.client.check()
            time.sleep(0.05)
        return sorted(self.client.owners.values(), key=lambda o: o.fragment)

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
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            try:
                self.client.fetch_ranges({0: [(0, 1)]})
                return "fetch"
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
            time.sleep(0.2)
        log.warning("initial_parameters_late", learner=self.settings.id)
        return "initialize"

    def _send_initial(self, initial: Any | Callable[[], Any]) -> None:
        """Every process makes its own shards of the initial values (one compiled function
        with the parameters' shardings) and sends its part of each fragment."""
        shardings = self.named.unflatten(self._shardings)  # type: ignore[arg-type]
        made = jax.jit(initial if callable(initial) else lambda: initial, out_shardings=shardings)
        flat = self.named.flatten(made())
        for p, shard in enumerate(self.shards):
            vector = self._host(p, self._shard_arrays(p, flat))
            segments, _ = _encode_runs(
                codecs.by_name("fp32"),
                _pick(vector, shard.sent_local),
                shard.sent_local,
                tuple(o for o, _ in shard.sent),
                0,
                codecs.DEFAULT_MAX_CHUNK_BYTES,
            )
            self.client.send_update(
                fragment=p,
                payload=segments,
                codec=fragment_pb2.CODEC_FP32,
                block_size=0,
                num_elements=shard.size,
                kind=session_pb2.UPDATE_KIND_INITIAL,
                seq=next(self._seqs),
                part=shard.part,
                parts=shard.parts if shard.parts > 1 else 0,
            )
        deadline = time.monotonic() + 60
        while self.client.unacked() and time.monotonic() < deadline:
            self.client.check()
            time.sleep(0.05)

    def _fetch_joined(self) -> list[tuple[int, np.ndarray]]:
        """Every fragment's global value at one version for all processes: the leader
        fetches the current ones and names their versions; the others fetch those."""
        wanted = {p: list(s.held) for p, s in enumerate(self.shards)}
        if self.group.leader:
            got = self.client.fetch_ranges(wanted)
            self.group.publish("joined", [g.version for g in got])
        else:
            versions = self.group.read("joined")
            got = self.client.fetch_ranges(wanted, dict(enumerate(versions)))
        got.sort(key=lambda g: g.fragment)
        for g in got:
            self._checksums[(g.fragment, g.version)] = g.checksum
            self.client.known_versions[g.fragment] = g.version
        return [(g.version, g.values) for g in got]

    # --- versions: the leader hands them on, every process fetches its own ranges --------
    def _follow_versions(self) -> None:
        structlog.contextvars.bind_contextvars(learner=self.settings.id, process=self.group.process)
        try:
            for i in itertools.count():
                event = self._next_event(i)
                if event is None:
                    return
                p, version = event
                got = self._fetch_version(p, version)
                with self._fetched:
                    self._events[i] = got
                    self._fetched.notify_all()
        except BaseException as err:  # the next tick raises it in the loop's thread
            with self._fetched:
                self._failed = err
                self._fetched.notify_all()

    def _next_event(self, i: int) -> tuple[int, int] | None:
        while not self._closed.is_set():
            if self.group.leader:
                try:
                    p, version = self.client.notices.get(timeout=0.5)
                except queue.Empty:
                    continue
                self.group.publish(f"event/{i}", [p, version])
                return p, version
            try:
                p, version = self.group.read(f"event/{i}", timeout_s=1.0)
                return int(p), int(version)
            except Exception:  # not published yet
                continue
        return None

    def _fetch_version(self, p: int, version: int) -> RangeValues:
        delays = backoff_delays(max_s=self.settings.max_backoff_s, initial_s=0.1)
        deadline = time.monotonic() + FETCH_TIMEOUT_S
        while True:
            try:
                return self.client.fetch_ranges({p: list(self.shards[p].held)}, {p: version})[0]
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"fragment {p} version {version}: this process could not fetch its "
                        f"values ({err.code()}); the learner must restart"
                    ) from None
                log.info("version_fetch_retry", fragment=p, version=version, code=str(err.code()))
                self._closed.wait(next(delays))

    # --- ticks: the leader decides, every process applies --------------------------------
    def _tick(self, wait: float = 0.0, halt: bool = False) -> tuple[bool, bool]:
        """One decision for every process; returns (whether a reply was adopted, whether
        to stop waiting)."""
        n = next(self._ticks)
        key = f"tick/{n // TICKS_KEPT}/{n}"
        if self.group.leader:
            verdict = self._decide(wait, halt)
            self.group.publish(key, verdict)
            if n % TICKS_KEPT == 0 and n >= 2 * TICKS_KEPT:  # read long ago by every process
                self.group.forget(f"tick/{n // TICKS_KEPT - 2}")
        else:
            verdict = self.group.read(key)
        for raw in verdict["acks"]:
            ack = session_pb2.Ack.FromString(bytes.fromhex(raw))
            self._final[ack.seq] = ack
            if not self.group.leader:
                self.client.settle(ack)
        if verdict["owners"] is not None and not self.group.leader:
            owners = session_pb2.OwnerMap.FromString(bytes.fromhex(verdict["owners"]))
            self.client.set_owners(owners.owners)
        self._finished = bool(verdict["finished"])
        if verdict["stop"]:
            self.stopping.set()
        adopted = False
        for event in self._take_events(int(verdict["events"])):
            self._checksums[(event.fragment, event.version)] = event.checksum
            f = self.outer.fragments[event.fragment]
            if f.receive(event.values, event.version):
                self._adopt(event.fragment, event.values, event.version)
                adopted = True
        return adopted, bool(verdict["halt"])

    def _decide(self, wait: float, halt: bool) -> dict[str, Any]:
        """The leader's tick: what it knows now (after waiting up to `wait` for news)."""
        deadline = time.monotonic() + wait
        while True:
            acks = {s: a for s, a in self.client.final_acks().items() if s not in self._relayed}
            with self._fetched:
                events = self._applied + len(self._events)
                if acks or events > self._applied or time.monotonic() >= deadline:
                    break
                self._fetched.wait(min(0.01, max(0.0, deadline - time.monotonic())))
        self._relayed |= set(acks)
        owners = sorted(self.client.owners.values(), key=lambda o: o.fragment)
        told = None
        if owners != self._owners_told:
            self._owners_told = owners
            told = session_pb2.OwnerMap(owners=owners).SerializeToString().hex()
        return {
            "events": events,
            "acks": [a.SerializeToString().hex() for _, a in sorted(acks.items())],
            "owners": told,
            "finished": self.client.job_finished,
            "stop": self.stop_requested.is_set(),
            "halt": halt,
        }

    def _take_events(self, through: int) -> list[RangeValues]:
        """The fetched versions up to event `through`, in order (waiting for this process's
        own fetches of them, if need be)."""
        out = []
        deadline = time.monotonic() + FETCH_TIMEOUT_S
        with self._fetched:
            while self._applied < through:
                if self._failed is not None:
                    raise self._failed
                got = self._events.pop(self._applied, None)
                if got is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError("this process's fetch of a new version never came")
                    self._fetched.wait(0.1)
                    continue
                out.append(got)
                self._applied += 1
        return out

    # --- the engine's hooks, each process on its own values -------------------------------
    def _apply_arrivals(self, timeout: float = 0.0) -> bool:
        return self._tick(wait=timeout)[0]

    def _final_ack(self, seq: int) -> session_pb2.Ack | None:
        return self._final.get(seq)

    def job_finished(self) -> bool:
        self.client.check()
        return self._finished

    def _wait_for(self, p: int, source: str, timeout: float = FINAL_SYNC_TIMEOUT_S) -> None:
        """Block until fragment p's reply is adopted; every process stops waiting at the
        tick where the leader gives up (its timeout, or a stop asked of it)."""
        t0 = time.monotonic()
        f = self.outer.fragments[p]
        while f.in_flight:
            self.client.check()
            self._drain_acks()
            late = time.monotonic() - t0 >= timeout or (
                self.stop_requested.is_set() and source == "waiting"
            )
            if self._tick(wait=TICK_WAIT_S, halt=late)[1]:
                break
        self.add_badput(source, time.monotonic() - t0)

    def _linger(self) -> None:
        t0 = time.monotonic()
        while True:
            late = time.monotonic() - t0 >= self.settings.linger_s or self.stop_requested.is_set()
            if self._tick(wait=0.2, halt=late)[1]:
                return
            self.heartbeat(done=True)

    def _fetch_refused(self) -> None:
        """A refused update's fragment continues from the newest global value every process
        already holds (versions reach all of them alike): nothing to fetch."""
        for p in sorted(self._refetch):
            f = self.outer.fragments[p]
            newer = f.latest is not None and f.latest_version > f.version
            self._adopt(p, f.latest if newer else f.base, max(f.version, f.latest_version))  # type: ignore[arg-type]
        self._refetch.clear()

    def heartbeat(
        self, done: bool = False, last_sent: bool = False, still_to_send: list[int] | None = None
    ) -> None:
        if self.group.leader:
            super().heartbeat(done=done, last_sent=last_sent, still_to_send=still_to_send)

    def _send(self, p: int) -> None:
        """Start this process's part of fragment p's update (every process does, at the same
        step, under the same seq); the encoder thread encodes and queues it."""
        f = self.outer.fragments[p]
        shard = self.shards[p]
        send = f.begin_send()
        seq = next(self._seqs)
        # A device-side copy: the loop's step may donate the parameters' buffers.
        snapshot = [jnp.copy(x) for x in self._shard_arrays(p, self._flat)]

        def encode_and_queue() -> tuple[int, int, float]:
            theta = self._host(p, snapshot)
            segments = f.encode(send, theta)
            self.client.send_update(
                fragment=p,
                payload=segments,
                codec=self.codec.wire,
                block_size=self.block_size,
                num_elements=shard.size,
                base_version=send.version,
                c_steps=send.steps,
                c_tokens=send.tokens,
                compute_seconds=send.compute_seconds,
                seq=seq,
                part=shard.part,
                parts=shard.parts if shard.parts > 1 else 0,
            )
            self.tape.write(
                "sent",
                uid=self._uid(seq),
                fragment=p,
                base_version=send.version,
                steps=send.steps,
                compute_seconds=round(send.compute_seconds, 6),
                process=self.group.process,
            )
            return seq, p, send.compute_seconds

        self._encoding.append(self._encoder.submit(encode_and_queue))

    def _adopt(
        self, p: int, value: np.ndarray, version: int, placed: list[jax.Array] | None = None
    ) -> None:
        f = self.outer.fragments[p]
        needs_local = self.alpha or (f.keep_progress and f.sent_theta is not None)
        theta = self._host(p, self._shard_arrays(p, self._flat)) if needs_local else value
        merged = f.local_value(theta, value, self.alpha)
        f.adopt(value, version)
        for leaf in self.layout.fragments[p].leaves:
            self._flat[leaf.name] = self._leaf(p, leaf.name, merged)

    def global_params(self, sharding: Any = None) -> Any:
        flat = {}
        for p, f in enumerate(self.outer.fragments):
            newer = f.latest is not None and f.latest_version > f.version
            vector = f.latest if newer else f.base
            for leaf in self.layout.fragments[p].leaves:
                flat[leaf.name] = self._leaf(p, leaf.name, vector)  # type: ignore[arg-type]
        return self.named.unflatten(flat)

    def summary(self, params: Any) -> dict[str, Any]:
        """As a learner of one process reports, but each fragment's checksum is that of the
        global value it ends on (every process adopted it for its own values), since no
        process holds a whole fragment to hash."""
        checksums = [
            self._checksums.get((p, max(f.version, f.latest_version)), 0)
            for p, f in enumerate(self.outer.fragments)
        ]
        self.record("finished", checksums=checksums, process=self.group.process)
        return {
            "incarnation": self.incarnation,
            "versions": [f.version for f in self.outer.fragments],
            "checksums": checksums,
            "bytes": {"up": self.client.stats.bytes_up, "down": self.client.stats.bytes_down},
            "reconnects": self.client.stats.reconnects,
            "shards": {  # this process's values of each fragment: held, and sent
                "process": self.group.process,
                "held": [s.length for s in self.shards],
                "sent": [sum(c for _, c in s.sent) for s in self.shards],
            },
        }

    def checkpoint_ready(self) -> bool:
        return False  # not yet: a restart resumes its read position only

    def restore(self, params: Any) -> None:
        return None

    def close(self) -> None:
        self._closed.set()
        super().close()

    # --- this process's shards ------------------------------------------------------------
    def _shard_arrays(self, p: int, flat: dict[str, jax.Array]) -> list[jax.Array]:
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
