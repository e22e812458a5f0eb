"""The learner's side of the atoll.v1 protocol, over background threads.

It knows nothing of JAX: it sends encoded fragments, hands back acks and new global
fragments as numpy arrays, and keeps the session alive. Two paths:
- the control session, with any synchronizer replica: hello, heartbeats; welcome, the owner
  map, commit notices, the job's status. When it breaks it reconnects
  (exponential backoff with jitter, over every address it was given) for as long as the
  learner lives, and fetches the fragments whose version moved while it was away. It never
  gives up on the synchronizer tier unless told to (`give_up_s`): the learner keeps training
  from what it holds meanwhile;
- ingest: each update goes, chunk by chunk, to the replica that owns its fragment (an Ingest
  call). An update is kept until its owner says it is committed; if the owner changes first
  (its epoch moves), it is sent again to the new owner, which deduplicates it;
- following: new global fragments come from each fragment's owner, on a Follow call to every
  replica of the owner map (a thread each), as deltas onto the values held or whole.
Sending never blocks the caller.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import structlog
import xxhash

from services import codec as codecs
from services import kernels
from services import telemetry as tm
from services.codec import Segment
from services.downlink import apply_segment
from services.gen.atoll.v1 import fragment_pb2, session_pb2, synchronizer_pb2
from services.grpcopts import backoff_delays, channel_options, target_host
from services.layout import LeafSpec
from services.wire import DEFAULT_MAX_CHUNK_BYTES, segments_header
from services.wirecount import counting_parser, counting_serializer

SERVICE = synchronizer_pb2.DESCRIPTOR.services_by_name["Synchronizer"].full_name

log = structlog.get_logger("atoll.learner.client")
# How soon a slot told its session is live elsewhere asks again (`_run`).
BUSY_RETRY_S = 1.0
INGEST_TIMEOUT_S = 120.0
NO_OWNER_WAIT_S = 0.2
INGEST_CALLS = 4  # updates on their way to owners at once (each its own Ingest call)
WAITING_LOG_S = 30.0  # how often a learner waiting for its first session says so


class SessionError(RuntimeError):
    """The synchronizer refused the session for a reason retrying will not fix, or no
    synchronizer answered for longer than the learner was told to wait (`give_up_s`)."""


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


@dataclass(eq=False)
class _Outgoing:
    """An update kept until committed (or refused, or, for initial values, taken)."""

    seq: int
    fragment: int
    chunks: list[session_pb2.UpdateChunk]
    received_epoch: int | None = None  # the owner epoch it was received under
    received_at: str = ""  # the address of the owner that received it
    retries: Iterator[float] | None = None  # delays between failed sends (backoff)
    not_before: float = 0.0  # monotonic time of its next send after a failed one


# What the session's stream sends: a message, or one already serialized.
Outbound = session_pb2.LearnerMessage | bytes


def _serialize(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


@dataclass
class ClientStats:
    bytes_up: int = 0
    bytes_down: int = 0
    reconnects: int = 0
    acks: dict[int, session_pb2.Ack] = field(default_factory=dict)  # final acks by seq
    received: int = 0  # RECEIVED acks, resends included


# A Follow refused for a reason a retry will not cure (an older replica, a credential), or
# ended because newer calls of this slot took its place (another process speaks for it):
# said as a warning, and tried again (the owner map or the replica may change).
_FOLLOW_REFUSED = {
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}
_FATAL = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ABORTED,
}


def status(err: BaseException) -> grpc.StatusCode | None:
    """A failed gRPC call's status code (None for any other error)."""
    code = getattr(err, "code", None) if isinstance(err, grpc.RpcError) else None
    return code() if callable(code) else None


def retryable(err: BaseException) -> bool:
    """Whether a failed call may succeed when tried again: any failure but a refusal (a
    call on a channel the session just replaced raises ValueError; so does a value that
    arrived garbled)."""
    return status(err) not in _FATAL


def describe(err: BaseException) -> str:
    """A failure in a word for the logs: its status code, else its message."""
    code = status(err)
    return str(code) if code is not None else str(err)


def segments_of(payload: bytes | Sequence[Segment], codec: int, n: int) -> list[Segment]:
    """An update's segments; a whole float32 payload is cut into segments of a chunk's size."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        return list(payload)
    if codec not in (fragment_pb2.CODEC_FP32, fragment_pb2.CODEC_UNSPECIFIED):
        raise ValueError("a payload of a blocked codec must be given as segments")
    step = DEFAULT_MAX_CHUNK_BYTES // 4
    data = bytes(payload)
    return [
        Segment(start, min(n, start + step) - start, data[4 * start : 4 * min(n, start + step)])
        for start in range(0, max(1, n), step)
    ]


class _Assembly:
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


class SynchronizerClient:
    def __init__(
        self,
        addresses: Sequence[str],
        *,
        job: str,
        learner_id: str,
        incarnation: str,
        params: Sequence[LeafSpec],
        token: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        max_backoff_s: float = 5.0,
        give_up_s: float = 0.0,
        routes: Mapping[str, str] | None = None,
        version_notices: bool = False,
        tls_server_name: str = "",
    ) -> None:
        """`credentials`: TLS (services.tls.learner_credentials); None: plaintext. `token`
        goes with every call as `authorization: Bearer` (per-slot or the job's). `routes`:
        advertised owner address -> the address this learner reaches it at. `give_up_s`:
        raise SessionError once no synchronizer has answered for this long (0: never).
        `version_notices`: the session is told new versions (into `notices`) instead of being
        sent their values (a learner of several processes fetches its ranges itself).
        `tls_server_name`: with TLS, the name each owner's certificate is checked against
        when this learner dials it at the address it advertises (an IP, in the chart): every
        replica holds the synchronizers' certificate, which names their Service, not their
        pods. Default: the host of the first address, as its session's channel checks."""
        if not addresses:
            raise ValueError("give at least one synchronizer address HOST:PORT")
        self.addresses = list(addresses)
        self.routes = dict(routes or {})
        self.job, self.learner_id, self.incarnation = job, learner_id, incarnation
        self.params = list(params)
        self.token = token
        self.credentials = credentials
        self.tls_server_name = tls_server_name or target_host(self.addresses[0])
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self.max_backoff_s = max_backoff_s
        self.give_up_s = give_up_s
        self._away_since: float | None = time.monotonic()  # no session since then
        self.stats = ClientStats()
        self.welcome: session_pb2.Welcome | None = None
        self.job_status: session_pb2.JobStatus | None = None  # newest, when the job has a budget
        self.fragments: queue.Queue[GlobalFragment] = queue.Queue()
        self.version_notices = version_notices
        self.notices: queue.Queue[tuple[int, int]] = queue.Queue()  # (fragment, version)
        self.known_versions: dict[int, int] = {}
        # The newest global value held per fragment, exactly as the synchronizer holds it:
        # deltas apply onto it (services.downlink).
        self._canonical: dict[int, tuple[int, np.ndarray]] = {}
        self.owners: dict[int, session_pb2.FragmentOwner] = {}
        self.step = 0
        self._seq = itertools.count(1)
        self._lock = threading.Condition()
        self._unacked: dict[int, _Outgoing] = {}
        self._outbox: queue.Queue[Outbound | None] | None = None
        self._channel: grpc.Channel | None = None
        self._owner_channels: dict[str, grpc.Channel] = {}
        self._closed = threading.Event()
        self._connected = threading.Event()
        self._fatal: SessionError | None = None
        self._address_cycle = itertools.cycle(self.addresses)
        self._thread: threading.Thread | None = None
        self._ingesters: list[threading.Thread] = []
        self._sending: set[int] = set()  # seqs on an Ingest call now
        # Follow calls, one a replica of the owner map (by the address it is reached at), and
        # the fragments each replica owned when its call began.
        self._following: dict[str, Any] = {}
        self._followed: dict[str, frozenset[int]] = {}
        self._data_only = False  # another process holds the session, and follows
        # Guards the values held (`_canonical`, `known_versions`): every Follow call's
        # thread assembles and hands on values.
        self._values_lock = threading.RLock()

    # --- lifecycle ----------------------------------------------------------------------
    def connect(self, stop: threading.Event | None = None) -> session_pb2.Welcome:
        """Open the session (in the background, reconnecting as needed); return the welcome.
        Waits for as long as no synchronizer answers (or until `give_up_s`, or `stop`)."""
        self._thread = threading.Thread(target=self._run, name="atoll-session", daemon=True)
        self._thread.start()
        self._warm()
        self._start_ingest()
        said = time.monotonic()
        while not self._connected.wait(0.5):
            try:
                self.check()
                if stop is not None and stop.is_set():
                    raise SessionError("stopped before any synchronizer answered")
            except SessionError:
                self.close()
                raise
            if time.monotonic() - said >= WAITING_LOG_S:
                said = time.monotonic()
                log.warning("no_synchronizer_yet", addresses=self.addresses)
        try:
            self.check()
        except SessionError:
            self.close()
            raise
        assert self.welcome is not None
        return self.welcome

    def connect_data(self) -> None:
        """Send updates and fetch values without a session of its own: another process of
        this learner holds the session and hands on what it says (`set_owners`, `settle`)."""
        self._data_only = True
        self._channel = self._open_channel(self.addresses[0])
        self._warm()
        self._start_ingest()

    def _warm(self) -> None:
        """Load the compiled decoders new values are applied with (from numba's cache) now,
        on a thread of their own, rather than by the first new value, which would wait for
        them a second or more."""
        threading.Thread(target=kernels.warm_decoders, name="atoll-warm", daemon=True).start()

    def _start_ingest(self) -> None:
        self._ingesters = [
            threading.Thread(target=self._ingest, name=f"atoll-ingest-{i}", daemon=True)
            for i in range(INGEST_CALLS)
        ]
        for thread in self._ingesters:
            thread.start()

    def set_owners(self, owners: Sequence[session_pb2.FragmentOwner]) -> None:
        """The owner map, as the session (of this or another process) told it."""
        self._on_owners(owners)

    def final_acks(self) -> dict[int, session_pb2.Ack]:
        """The final acks so far, by seq (a copy)."""
        with self._lock:
            return dict(self.stats.acks)

    def settle(self, ack: session_pb2.Ack) -> None:
        """An update's final ack, as the session (of this or another process) got it."""
        with self._lock:
            self._finish(ack)

    def wait_closed(self, timeout: float) -> bool:
        """Whether the client was closed, waiting at most `timeout` seconds for it."""
        return self._closed.wait(timeout)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._lock.notify_all()
        outbox = self._outbox
        if outbox is not None:
            outbox.put(None)
        with self._lock:
            following = list(self._following.values())
        for call in following:
            if call is not None:
                call.cancel()
        for thread in (self._thread, *self._ingesters):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5)
        if self._channel is not None:
            self._channel.close()
        with self._lock:
            channels = list(self._owner_channels.values())
        for channel in channels:
            channel.close()

    def check(self) -> None:
        """Raise the session's fatal error, if the synchronizer refused it, or SessionError
        once no synchronizer has answered for `give_up_s` (when one is set)."""
        if self._fatal is not None:
            raise self._fatal
        away = self._away_since
        if self.give_up_s > 0 and away is not None and time.monotonic() - away > self.give_up_s:
            raise SessionError(
                f"no synchronizer answered for {self.give_up_s:.0f} s at "
                f"{', '.join(self.addresses)}; check the addresses and that one is running "
                "(--give-up-s 0 retries for as long as the learner lives)"
            )

    # --- sending ------------------------------------------------------------------------
    def send_update(
        self,
        *,
        fragment: int,
        payload: bytes | Sequence[Segment],
        codec: int,
        block_size: int,
        num_elements: int,
        base_version: int = 0,
        c_steps: int = 0,
        c_tokens: int = 0,
        compute_seconds: float = 0.0,
        tensor_norms: Sequence[float] = (),
        kind: int = session_pb2.UPDATE_KIND_OUTER_GRADIENT,
        seq: int | None = None,
        part: int = 0,
        parts: int = 0,
    ) -> int:
        """Queue one update; return its seq. It is sent to its fragment's owner, and again
        to a new owner, until it is committed. A process of a learner over several hosts
        sends its part (`part` of `parts`, only its values' segments) under the `seq` every
        process of the learner gives that update."""
        seq = next(self._seq) if seq is None else seq
        segments = segments_of(payload, codec, num_elements)
        header = segments_header(fragment, codec, block_size, num_elements, segments)
        chunks = []
        for i, s in enumerate(segments):
            chunk = session_pb2.UpdateChunk(
                kind=kind,  # type: ignore[arg-type]
                seq=seq,
                base_version=base_version,
                c_steps=c_steps,
                c_tokens=c_tokens,
                compute_seconds=compute_seconds,
                chunk_index=i,
                data=bytes(s.data),  # encoded here: bytes already, not copied
                value_offset=s.offset,
                value_count=s.count,
                learner_id=self.learner_id,
                incarnation=self.incarnation,
                part=part,
                parts=parts,
            )
            chunk.header.CopyFrom(header)
            if i == 0:
                chunk.tensor_norms.extend(tensor_norms)
            chunks.append(chunk)
        with self._lock:
            self._unacked[seq] = _Outgoing(seq, fragment, chunks)
            self._lock.notify_all()
        return seq

    def send_initial(self, fragment: int, values: np.ndarray) -> int:
        """Queue a fragment of the job's initial parameters (float32, kind INITIAL)."""
        flat = np.ascontiguousarray(values, "<f4")
        return self.send_update(
            fragment=fragment,
            payload=flat.tobytes(),
            codec=fragment_pb2.CODEC_FP32,
            block_size=0,
            num_elements=flat.size,
            kind=session_pb2.UPDATE_KIND_INITIAL,
        )

    def fetch_ranges(
        self,
        ranges: Mapping[int, Sequence[tuple[int, int]]],
        versions: Mapping[int, int] | None = None,
    ) -> list[RangeValues]:
        """The values of `ranges` ((offset, count) pairs, increasing) of each fragment, at
        `versions` (absent: the current one), each fragment's checked against its checksum."""
        assert self._channel is not None, "connect() first"
        fetch = self._method("unary_stream", "FetchState", fragment_pb2.GlobalFragmentChunk)
        request = synchronizer_pb2.FetchStateRequest(
            job=self.job, fragments=list(ranges), versions=dict(versions or {})
        )
        for p, wanted in ranges.items():
            request.ranges[p].offsets.extend(o for o, _ in wanted)
            request.ranges[p].counts.extend(c for _, c in wanted)
        parts: dict[int, list[fragment_pb2.GlobalFragmentChunk]] = {}
        for chunk in fetch(request, timeout=120, metadata=self._metadata):
            parts.setdefault(chunk.header.fragment, []).append(chunk)
        out = []
        for p, wanted in ranges.items():
            chunks = parts.get(p, [])
            hasher = xxhash.xxh3_64()
            for chunk in chunks:
                hasher.update(chunk.data)
            header = chunks[0].header if chunks else None
            expected = [(int(c.value_offset), int(c.value_count)) for c in chunks]
            if (
                header is None
                or len(chunks) != header.chunk_count
                or hasher.intdigest() != header.checksum
                or _joined(expected) != _joined(list(wanted))
            ):
                raise ValueError(f"fragment {p}: the ranges fetched are not those asked for")
            values = np.frombuffer(b"".join(c.data for c in chunks), "<f4").astype(np.float32)
            out.append(RangeValues(p, chunks[0].version, values, chunks[0].value_checksum))
        return out

    def ingest_raw(self, chunks: Sequence[session_pb2.UpdateChunk]) -> session_pb2.Ack:
        """Send hand-built chunks as they are to their fragment's owner (protocol tests)."""
        fragment = chunks[0].header.fragment
        deadline = time.monotonic() + 30
        while not self.owners:
            if time.monotonic() > deadline:
                raise TimeoutError("no fragment owner is known")
            time.sleep(0.05)
        # A fragment that does not exist has no owner: any replica refuses it.
        owner = self.owners.get(fragment) or next(iter(self.owners.values()))
        call = self._ingest_call(owner.address)
        ack: session_pb2.Ack = call(iter(chunks), timeout=INGEST_TIMEOUT_S, metadata=self._metadata)
        return ack

    def heartbeat(
        self,
        *,
        step: int,
        step_time_ema_s: float,
        tokens_per_s: float,
        loss: float,
        eval_loss: float,
        done: bool = False,
        last_sent: bool = False,
        still_to_send: list[int] | None = None,
    ) -> None:
        self.step = step
        outbox = self._outbox
        if outbox is not None and self._connected.is_set():
            outbox.put(
                session_pb2.LearnerMessage(
                    heartbeat=session_pb2.Heartbeat(
                        step=step,
                        step_time_ema_s=step_time_ema_s,
                        tokens_per_s=tokens_per_s,
                        loss=loss,
                        eval_loss=eval_loss,
                        done=done,
                        last_sent=last_sent,
                        finishing=still_to_send is not None,
                        still_to_send=still_to_send or [],
                    )
                )
            )

    def wait_ack(self, seq: int, timeout: float, received: bool = False) -> session_pb2.Ack:
        """Wait for an update's final ack (or, with `received`, for its owner to have it)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                self.check()
                if seq in self.stats.acks:
                    return self.stats.acks[seq]
                out = self._unacked.get(seq)
                if received and out is not None and out.received_epoch is not None:
                    return session_pb2.Ack(
                        seq=seq, status=session_pb2.ACK_STATUS_RECEIVED, epoch=out.received_epoch
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no ack for update {seq} within {timeout:.1f} s")
                self._lock.wait(min(left, 0.5))

    def unacked(self) -> int:
        """Updates not committed (or refused) yet."""
        with self._lock:
            return len(self._unacked)

    def _finish(self, ack: session_pb2.Ack) -> None:
        """An update's final ack (under the lock)."""
        if ack.seq in self._unacked:
            del self._unacked[ack.seq]
            self.stats.acks[ack.seq] = ack
            self._lock.notify_all()

    # --- ingest: updates to their fragments' owners -------------------------------------
    def _owner_channel(self, address: str) -> grpc.Channel:
        """The channel to an owner, by the address it is reached at (under lock)."""
        channel = self._owner_channels.get(address)
        if channel is None:
            channel = self._open_channel(address, owner=True)
            self._owner_channels[address] = channel
            self._watch(address, channel)
        return channel

    def _reached_at(self, address: str) -> str:
        """Where this learner reaches a replica that advertises `address` (`routes`)."""
        return self.routes.get(address, address)

    def _ingest_call(self, address: str) -> Any:
        channel = self._owner_channel(self._reached_at(address))
        return self._method("stream_unary", "Ingest", session_pb2.Ack, channel)

    def _open_channel(self, address: str, owner: bool = False) -> grpc.Channel:
        # A connection of its own (not shared with other clients of this process, as gRPC
        # shares them by default): per-connection limits count this learner's calls only.
        options: list[tuple[str, int | str]] = [
            *channel_options(self.max_backoff_s),
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if self.credentials is None:
            return grpc.insecure_channel(address, options=options)
        if owner and self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return grpc.secure_channel(address, self.credentials, options=options)

    def _watch(self, address: str, channel: grpc.Channel) -> None:
        """When the connection to an owner drops, the updates it had only received may have
        died with its round (a killed replica, a lost lease): they are sent again at once,
        without waiting for the session to bring the new owner map (which takes a lease when
        the session's replica died too). An owner that still holds one answers `received`."""
        connected = False

        def changed(state: grpc.ChannelConnectivity) -> None:
            nonlocal connected
            if state == grpc.ChannelConnectivity.READY:
                connected = True
                return
            if not connected:
                return
            connected = False
            with self._lock:
                for out in self._unacked.values():
                    if out.received_at == address:
                        out.received_epoch = None
                self._lock.notify_all()

        channel.subscribe(changed, try_to_connect=False)

    def _next_to_send(self) -> tuple[_Outgoing, session_pb2.FragmentOwner] | None:
        """The oldest update that its fragment's current owner may not hold and that is not
        waiting out a failed send's backoff (under lock). One received under a later epoch
        than the owner map's is held: the map is behind.

        A fragment's updates go in the order they were made: a later one waits while an
        earlier one is in flight or backing off. An owner takes one update of a learner per
        open round, so a later update sent first would push the earlier one a round back."""
        now = time.monotonic()
        waiting: set[int] = set()  # fragments with an earlier update not yet received
        for seq in sorted(self._unacked):
            out = self._unacked[seq]
            owner = self.owners.get(out.fragment)
            if owner is None or not out.chunks:  # no owner yet, or others send it
                continue
            if out.received_epoch is not None and out.received_epoch >= owner.epoch:
                continue
            if out.fragment in waiting:
                continue
            waiting.add(out.fragment)
            if seq not in self._sending and out.not_before <= now:
                return out, owner
        return None

    def _failed(self, out: _Outgoing) -> None:
        """A send of `out` failed: it waits its next backoff delay (under lock). The delay is
        the update's own, so the ingest threads do not take turns retrying it at once."""
        if out.retries is None:
            out.retries = backoff_delays(max_s=self.max_backoff_s, initial_s=0.1)
        out.not_before = time.monotonic() + next(out.retries)
        self._sending.discard(out.seq)

    def _ingest(self) -> None:
        self._bind_log_context()
        while not self._closed.is_set():
            with self._lock:
                picked = self._next_to_send()
                if picked is None:
                    self._lock.wait(NO_OWNER_WAIT_S)
                    continue
                out, owner = picked
                self._sending.add(out.seq)
                call = self._ingest_call(owner.address)
            try:
                ack = call(iter(out.chunks), timeout=INGEST_TIMEOUT_S, metadata=self._metadata)
            except grpc.RpcError as err:
                # The owner map will move (a new owner) or the owner comes back: again later.
                log.info(
                    "ingest_retry",
                    fragment=out.fragment,
                    seq=out.seq,
                    owner=owner.replica,
                    code=str(status(err)),
                )
                with self._lock:
                    self._failed(out)
                continue
            if (
                ack.status == session_pb2.ACK_STATUS_REJECTED
                and ack.code == grpc.StatusCode.UNAVAILABLE.value[0]
            ):
                # The owner could not take it for now (its store is away): again later.
                log.info("ingest_unavailable", seq=out.seq, reason=ack.reason)
                with self._lock:
                    self._failed(out)
                continue
            with self._lock:
                self._sending.discard(out.seq)
                out.retries, out.not_before = None, 0.0
                if ack.status == session_pb2.ACK_STATUS_RECEIVED:
                    self.stats.received += 1
                    current = self._unacked.get(out.seq)
                    if current is not None:
                        current.received_epoch = ack.epoch
                        current.received_at = self._reached_at(owner.address)
                        self._lock.notify_all()
                else:
                    self._finish(ack)

    # --- following: new global fragments from their owners --------------------------------
    def _owner_addresses(self) -> set[str]:
        """The replicas of the owner map, by the address each is reached at (under lock)."""
        return {self._reached_at(o.address) for o in self.owners.values()}

    def _owned_by(self, address: str) -> frozenset[int]:
        """The fragments the replica at `address` owns, as the owner map says (under lock)."""
        return frozenset(
            p for p, o in self.owners.items() if self._reached_at(o.address) == address
        )

    def _follow_owners(self) -> None:
        """Follow every replica of the owner map; stop following those that left it, and
        follow again a replica that took fragments over since its call began: it knows
        only what the learner held then, and would send a fragment it took from there (under
        lock)."""
        if self.version_notices or self._data_only or self._closed.is_set():
            return
        wanted = self._owner_addresses()
        for address, call in self._following.items():
            if call is None:
                continue
            owned = self._owned_by(address)
            if address not in wanted:
                call.cancel()  # its thread sees the map moved and ends
            elif not owned <= self._followed.get(address, frozenset()):
                call.cancel()  # its thread follows again, from the values held now
            else:
                self._followed[address] = owned  # one it loses, then takes back, counts
        for address in wanted - set(self._following):
            self._following[address] = None
            threading.Thread(
                target=self._follow, args=(address,), name="atoll-follow", daemon=True
            ).start()

    def _follow_request(self) -> synchronizer_pb2.FollowRequest:
        """What this learner holds: its values, or, for a fragment it has none of yet, the
        version it joined at (it fetches at least that one: no newer one is missed)."""
        joined = self.welcome.versions if self.welcome is not None else []
        held = dict(enumerate(joined))
        with self._values_lock:
            held.update((p, v) for p, (v, _) in self._canonical.items())
        return synchronizer_pb2.FollowRequest(job=self.job, held=held, learner_id=self.learner_id)

    def _follow(self, address: str) -> None:
        """New global values of the fragments `address` owns, for as long as it owns some:
        followed again when the call breaks (at once when this learner ended it, to follow
        from what it holds now; else with backoff, reset once a call brought values)."""
        self._bind_log_context()
        delays = backoff_delays(max_s=self.max_backoff_s, initial_s=0.1)
        try:
            while not self._closed.is_set():
                with self._lock:
                    if address not in self._owner_addresses():
                        return
                    channel = self._owner_channel(address)
                    follow = self._method(
                        "unary_stream", "Follow", session_pb2.SynchronizerMessage, channel
                    )
                    followed = self._owned_by(address)
                responses: Any = None
                taken = [0]  # chunks the call brought
                try:
                    responses = follow(self._follow_request(), metadata=self._metadata)
                    with self._lock:
                        self._following[address] = responses
                        self._followed[address] = followed
                        moved = address not in self._owner_addresses()
                    if moved or self._closed.is_set():
                        continue
                    self._take_fragments(responses, taken, channel)
                    continue  # the replica ended it (it drains): follow again at once
                except grpc.RpcError as err:
                    code = status(err)
                    if code == grpc.StatusCode.CANCELLED:
                        continue  # this learner ended it: the map moved
                    level = log.warning if code in _FOLLOW_REFUSED else log.info
                    level(
                        "follow_broken",
                        address=address,
                        code=str(code),
                        details=err.details() if hasattr(err, "details") else str(err),
                    )
                except Exception as err:  # a garbled value, a channel closed meanwhile
                    log.warning("follow_broken", address=address, error=str(err))
                finally:
                    if responses is not None:
                        responses.cancel()
                    if taken[0]:
                        delays = backoff_delays(max_s=self.max_backoff_s, initial_s=0.1)
                self._closed.wait(next(delays))
        finally:
            with self._lock:
                self._following.pop(address, None)
                self._followed.pop(address, None)
                if not self._closed.is_set():
                    self._follow_owners()  # the map may have moved back meanwhile

    def _take_fragments(
        self,
        responses: Iterable[session_pb2.SynchronizerMessage],
        taken: list[int],
        channel: grpc.Channel,
    ) -> None:
        """Assemble and hand on the global values one Follow call brings, counting its
        chunks into `taken`; a fragment whose delta does not follow the values held is
        fetched over `channel` (the owner's: the session's may be reconnecting)."""
        assembling: dict[int, _Assembly] = {}
        for message in responses:
            taken[0] += 1
            if message.WhichOneof("kind") != "fragment":
                continue
            try:
                got = self._assemble(assembling, message.fragment, channel)
            except ValueError as err:
                log.warning("fragment_dropped", error=str(err))
                assembling.pop(message.fragment.header.fragment, None)
                continue
            if got is not None:
                self._hold(got)
                self._deliver(got)

    # --- fetching -----------------------------------------------------------------------
    def fetch_state(
        self,
        fragments: Sequence[int] = (),
        held: Mapping[int, np.ndarray] | None = None,
        *,
        retry: bool = True,
    ) -> list[GlobalFragment]:
        """The current global value of `fragments` (all if empty), over the unary stream;
        the caller adopts them (they count as known). A fragment in `held` whose current value
        is that array (same checksum) is not sent again: the held array comes back instead.
        A failure a retry may cure (no replica answers, the session moved to another one) is
        retried with backoff, as the session is (until `give_up_s`, if set); `retry=False`
        tries once and raises grpc.RpcError or ValueError. A refusal always raises."""
        delays = backoff_delays(max_s=self.max_backoff_s, initial_s=0.1)
        while True:
            try:
                out = self._fetch(fragments, held or {})
                break
            except (grpc.RpcError, ValueError) as err:
                if not retry or not retryable(err):
                    raise
                log.info("fetch_retry", error=describe(err))
            if self._closed.wait(next(delays)):
                raise SessionError("the session was closed while fetching the global model")
            self.check()
        with self._values_lock:
            for g in out:
                self.known_versions[g.fragment] = max(
                    self.known_versions.get(g.fragment, -1), g.version
                )
        return out

    def _fetch(
        self,
        fragments: Sequence[int],
        held: Mapping[int, np.ndarray] | None = None,
        channel: grpc.Channel | None = None,
    ) -> list[GlobalFragment]:
        """The current values of `fragments` over `channel` (default: the session's)."""
        assert (channel or self._channel) is not None, "connect() first"
        mine = {p: np.ascontiguousarray(v, "<f4") for p, v in (held or {}).items()}
        fetch = self._method(
            "unary_stream", "FetchState", fragment_pb2.GlobalFragmentChunk, channel
        )
        request = synchronizer_pb2.FetchStateRequest(
            job=self.job,
            fragments=list(fragments),
            held={p: codecs.checksum(v.tobytes()) for p, v in mine.items()},
        )
        out: list[GlobalFragment] = []
        assembling: dict[int, _Assembly] = {}
        for chunk in fetch(request, timeout=120, metadata=self._metadata):
            p = chunk.header.fragment
            if chunk.unchanged and p in mine:
                out.append(GlobalFragment(p, chunk.version, mine[p].copy()))
                continue
            got = self._assemble(assembling, chunk)
            if got is not None:
                out.append(got)
        for g in out:
            self._hold(g)
        return out

    # --- the session thread -------------------------------------------------------------
    def _method(
        self, kind: str, name: str, response: Any, channel: grpc.Channel | None = None
    ) -> Any:
        """A call of the synchronizer service whose messages count their bytes on the way,
        over `channel` (default: the session's)."""
        return getattr(channel or self._channel, kind)(
            f"/{SERVICE}/{name}",
            request_serializer=counting_serializer(_serialize, self._count_up),
            response_deserializer=counting_parser(response.FromString, self._count_down),
        )

    def _count_up(self, size: int) -> None:
        self.stats.bytes_up += size
        tm.LEARNER_BYTES.labels(direction="up").inc(size)

    def _count_down(self, size: int) -> None:
        self.stats.bytes_down += size
        tm.LEARNER_BYTES.labels(direction="down").inc(size)

    def _requests(self, outbox: queue.Queue[Outbound | None]) -> Iterator[Outbound]:
        while True:
            message = outbox.get()
            if message is None:
                return
            yield message

    def _hello(self) -> session_pb2.LearnerMessage:
        return session_pb2.LearnerMessage(
            hello=session_pb2.Hello(
                job=self.job,
                learner_id=self.learner_id,
                incarnation=self.incarnation,
                params=[
                    fragment_pb2.TensorSpec(name=p.name, shape=p.shape, dtype=p.dtype)
                    for p in self.params
                ],
                step=self.step,
                version_notices=self.version_notices,
            )
        )

    def _bind_log_context(self) -> None:
        """This thread's log lines name the learner slot, its incarnation and job."""
        structlog.contextvars.bind_contextvars(
            learner=self.learner_id, incarnation=self.incarnation, job=self.job
        )

    def _run(self) -> None:
        self._bind_log_context()
        delays = backoff_delays(max_s=self.max_backoff_s, initial_s=min(1.0, self.max_backoff_s))
        # A replica that said this slot's session is still live elsewhere (its replica died
        # less than a lease ago) answers: ask it again each second until that lease lapses,
        # not in turn with addresses that may be dead, nor after a growing backoff, so the
        # slot is back in the job within a second of the lapse.
        busy_at: str | None = None
        while not self._closed.is_set():
            address = busy_at or next(self._address_cycle)
            busy_at = None
            # Until a first welcome, a broken attempt is still the learner's first session
            # (a replica waiting for the job's initializer refuses it for now), not a reconnect.
            first = self.welcome is None
            try:
                self._session(address, first)
                delays = backoff_delays(
                    max_s=self.max_backoff_s, initial_s=min(1.0, self.max_backoff_s)
                )
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                details = err.details() if hasattr(err, "details") else str(err)
                if code in _FATAL:
                    self._fatal = SessionError(f"synchronizer refused the session: {details}")
                    self._connected.set()
                    log.error("session_refused", code=str(code), details=details)
                    return
                log.info("session_broken", address=address, code=str(code), details=details)
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    busy_at = address
            except ValueError as err:  # a garbled value while catching up: start over
                log.warning("session_broken", address=address, error=str(err))
            finally:
                self._connected.clear()
                if self._away_since is None:
                    self._away_since = time.monotonic()
            if self._closed.is_set():
                return
            if self.welcome is not None:  # a session was open: this is a reconnect
                self.stats.reconnects += 1
            self._closed.wait(min(BUSY_RETRY_S, self.max_backoff_s) if busy_at else next(delays))

    def _session(self, address: str, first: bool) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._open_channel(address)
        session = self._method("stream_stream", "Session", session_pb2.SynchronizerMessage)
        outbox: queue.Queue[Outbound | None] = queue.Queue()
        outbox.put(self._hello())
        self._outbox = outbox
        responses = session(self._requests(outbox), metadata=self._metadata)
        try:
            for message in responses:
                kind = message.WhichOneof("kind")
                if kind == "welcome":
                    self._on_welcome(message.welcome, first)
                elif kind == "ack":
                    with self._lock:
                        self._finish(message.ack)
                elif kind == "owners":
                    self._on_owners(message.owners.owners)
                elif kind == "status":
                    self.job_status = message.status
                elif kind == "version":
                    self._notice(message.version.fragment, message.version.version)
                if self._closed.is_set():
                    break
        finally:
            outbox.put(None)
            responses.cancel()

    def _on_owners(self, owners: Sequence[session_pb2.FragmentOwner]) -> None:
        with self._lock:
            before = self.owners
            self.owners = {o.fragment: o for o in owners}
            # A failed send's backoff waited for the old owner: a new one is tried at once.
            for out in self._unacked.values():
                old, new = before.get(out.fragment), self.owners.get(out.fragment)
                if new is not None and (
                    old is None or (old.epoch, old.address) != (new.epoch, new.address)
                ):
                    out.retries, out.not_before = None, 0.0
            self._follow_owners()
            self._lock.notify_all()

    def _on_welcome(self, welcome: session_pb2.Welcome, first: bool) -> None:
        self.welcome = welcome
        if welcome.HasField("status"):
            self.job_status = welcome.status
        self._on_owners(welcome.owners)
        if not first:
            with self._lock:
                # Commit notices may have gone by while away: ask each owner again.
                for out in self._unacked.values():
                    out.received_epoch = None
                pending = len(self._unacked)
                self._lock.notify_all()
            tm.REJOINS.inc()
            moved = [
                p for p, v in enumerate(welcome.versions) if v > self.known_versions.get(p, -1)
            ]
            log.info(
                "reconnected",
                synchronizer=welcome.synchronizer_id,
                resent=pending,
                moved=len(moved),
            )
            if moved and welcome.initialized and self.version_notices:
                for p in moved:
                    self._notice(p, welcome.versions[p])
            elif moved and welcome.initialized:
                for g in self.fetch_state(moved, retry=False):
                    self.fragments.put(g)
        self._away_since = None
        self._connected.set()

    @property
    def job_finished(self) -> bool:
        """The job's step budget is spent: finish now (final sync), whatever --steps says."""
        return self.job_status is not None and self.job_status.finish

    def _assemble(
        self,
        assembling: dict[int, _Assembly],
        chunk: fragment_pb2.GlobalFragmentChunk,
        channel: grpc.Channel | None = None,
    ) -> GlobalFragment | None:
        """A whole global value from its chunks: sent whole, or rebuilt from a delta onto the
        value held (a delta that does not follow it brings a whole copy instead, fetched
        over `channel`, default: the session's)."""
        p = chunk.header.fragment
        if chunk.chunk_index == 0:
            base = None
            if chunk.delta:
                held = self._canonical.get(p)
                if held is not None and held[0] >= chunk.version:
                    return None  # already held (a whole copy overtook this delta)
                if held is None or held[0] != chunk.base_version:
                    log.info(
                        "delta_gap", fragment=p, held=held and held[0], base=chunk.base_version
                    )
                    # Delivered by the caller, like a pushed value.
                    fetched = self._fetch([p], channel=channel)
                    return fetched[0] if fetched else None
                base = held[1]
            assembling[p] = _Assembly(chunk, base)
        assembly = assembling.get(p)
        if assembly is None or assembly.version != chunk.version:
            return None  # the rest of a value whose start was skipped
        if not assembly.feed(chunk):
            return None
        del assembling[p]
        return GlobalFragment(p, assembly.version, assembly.values)

    def _hold(self, got: GlobalFragment) -> None:
        with self._values_lock:
            held = self._canonical.get(got.fragment)
            if held is None or got.version > held[0]:
                self._canonical[got.fragment] = (got.version, got.values)

    def _notice(self, fragment: int, version: int) -> None:
        if version > self.known_versions.get(fragment, -1):
            self.known_versions[fragment] = version
            self.notices.put((fragment, version))

    def _deliver(self, got: GlobalFragment) -> None:
        with self._values_lock:
            if got.version <= self.known_versions.get(got.fragment, -1):
                return
            self.known_versions[got.fragment] = got.version
            self.fragments.put(got)


def _joined(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges with neighbours joined: the same values however they are cut in chunks."""
    out: list[tuple[int, int]] = []
    for offset, count in ranges:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + count)
        else:
            out.append((offset, count))
    return out
