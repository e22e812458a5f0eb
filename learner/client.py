"""The learner's side of the atoll.v1 protocol, over a background stream.

It knows nothing of JAX: it sends encoded fragments, hands back acks and new global
fragments as numpy arrays, and keeps the session alive. When the stream breaks it
reconnects (exponential backoff with jitter, over every synchronizer address it was given),
re-sends every update not yet acknowledged (the synchronizer deduplicates them) and fetches
the fragments whose version moved while it was away. Sending never blocks the caller.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import structlog
from google.protobuf.message import Message

from services import codec as codecs
from services import telemetry as tm
from services.downlink import apply_delta
from services.gen.atoll.v1 import fragment_pb2, session_pb2, synchronizer_pb2
from services.grpcopts import backoff_delays, channel_options
from services.layout import LeafSpec
from services.wire import DEFAULT_MAX_CHUNK_BYTES, ChunkAssembler, make_header, split
from services.wirecount import counting_parser, counting_serializer

SERVICE = synchronizer_pb2.DESCRIPTOR.services_by_name["Synchronizer"].full_name

log = structlog.get_logger("atoll.learner.client")
RESEND_DELAY_S = 0.5


class SessionError(RuntimeError):
    """The synchronizer refused the session for a reason retrying will not fix."""


@dataclass(frozen=True)
class GlobalFragment:
    fragment: int
    version: int
    values: np.ndarray


@dataclass
class _Outgoing:
    seq: int
    messages: list[bytes]  # serialized once; a re-send after a reconnect sends them again


# What the session's stream sends: a message, or one already serialized (an update's chunk).
Outbound = session_pb2.LearnerMessage | bytes


def _serialize(message: Message | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


@dataclass
class ClientStats:
    bytes_up: int = 0
    bytes_down: int = 0
    reconnects: int = 0
    acks: dict[int, session_pb2.Ack] = field(default_factory=dict)


_FATAL = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ABORTED,
}


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
        max_backoff_s: float = 5.0,
        connect_timeout_s: float = 30.0,
    ) -> None:
        if not addresses:
            raise ValueError("give at least one synchronizer address HOST:PORT")
        self.addresses = list(addresses)
        self.job, self.learner_id, self.incarnation = job, learner_id, incarnation
        self.params = list(params)
        self.token = token
        self.max_backoff_s = max_backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.stats = ClientStats()
        self.welcome: session_pb2.Welcome | None = None
        self.job_status: session_pb2.JobStatus | None = None  # newest, when the job has a budget
        self.fragments: queue.Queue[GlobalFragment] = queue.Queue()
        self.known_versions: dict[int, int] = {}
        # The newest global value held per fragment, exactly as the synchronizer holds it:
        # deltas apply onto it (services.downlink).
        self._canonical: dict[int, tuple[int, np.ndarray]] = {}
        self.step = 0
        self._seq = itertools.count(1)
        self._lock = threading.Condition()
        self._unacked: dict[int, _Outgoing] = {}
        self._outbox: queue.Queue[Outbound | None] | None = None
        self._channel: grpc.Channel | None = None
        self._closed = threading.Event()
        self._connected = threading.Event()
        self._fatal: SessionError | None = None
        self._address_cycle = itertools.cycle(self.addresses)
        self._thread: threading.Thread | None = None

    # --- lifecycle ----------------------------------------------------------------------
    def connect(self) -> session_pb2.Welcome:
        """Open the session (in the background, reconnecting as needed); return the welcome."""
        self._thread = threading.Thread(target=self._run, name="atoll-session", daemon=True)
        self._thread.start()
        if not self._connected.wait(self.connect_timeout_s):
            self.close()
            if self._fatal is not None:
                raise self._fatal
            raise SessionError(
                f"no synchronizer answered within {self.connect_timeout_s:.0f} s at "
                f"{', '.join(self.addresses)}; check the addresses and that one is running"
            )
        if self._fatal is not None:
            raise self._fatal
        assert self.welcome is not None
        return self.welcome

    def close(self) -> None:
        self._closed.set()
        outbox = self._outbox
        if outbox is not None:
            outbox.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._channel is not None:
            self._channel.close()

    def check(self) -> None:
        """Raise the session's fatal error, if the synchronizer refused it."""
        if self._fatal is not None:
            raise self._fatal

    # --- sending ------------------------------------------------------------------------
    def send_update(
        self,
        *,
        fragment: int,
        payload: bytes,
        codec: int,
        block_size: int,
        num_elements: int,
        base_version: int = 0,
        c_steps: int = 0,
        c_tokens: int = 0,
        compute_seconds: float = 0.0,
        kind: int = session_pb2.UPDATE_KIND_OUTER_GRADIENT,
        max_chunk: int | None = None,
    ) -> int:
        """Queue one update; return its seq. It is re-sent after a reconnect until acked."""
        size = max_chunk or (
            self.welcome.config.max_chunk_bytes if self.welcome else DEFAULT_MAX_CHUNK_BYTES
        )
        seq = next(self._seq)
        header = make_header(fragment, codec, block_size, num_elements, payload, size)
        # Built in place and serialized here, in the caller's thread: a chunk's bytes are
        # copied once into the message and once out, and the stream's thread only sends.
        messages: list[bytes] = []
        for i, data in enumerate(split(payload, size)):
            built = session_pb2.LearnerMessage()
            chunk = built.update  # set in place: no copy of a built chunk
            chunk.header.CopyFrom(header)
            chunk.kind = kind  # type: ignore[assignment]
            chunk.seq, chunk.base_version, chunk.chunk_index = seq, base_version, i
            chunk.c_steps, chunk.c_tokens = c_steps, c_tokens
            chunk.compute_seconds = compute_seconds
            chunk.data = data
            messages.append(built.SerializeToString())
        with self._lock:
            self._unacked[seq] = _Outgoing(seq, messages)
            outbox = self._outbox
            if outbox is not None and self._connected.is_set():
                for serialized in messages:
                    outbox.put(serialized)
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

    def send_raw(self, chunks: Sequence[session_pb2.UpdateChunk]) -> None:
        """Put hand-built chunks on the stream as they are (for protocol tests)."""
        with self._lock:
            assert self._outbox is not None
            for chunk in chunks:
                self._unacked.setdefault(chunk.seq, _Outgoing(chunk.seq, []))
                self._outbox.put(session_pb2.LearnerMessage(update=chunk).SerializeToString())

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

    def wait_ack(self, seq: int, timeout: float) -> session_pb2.Ack:
        deadline = time.monotonic() + timeout
        with self._lock:
            while seq not in self.stats.acks:
                self.check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no ack for update {seq} within {timeout:.1f} s")
                self._lock.wait(min(left, 0.5))
            return self.stats.acks[seq]

    def unacked(self) -> int:
        with self._lock:
            return len(self._unacked)

    # --- fetching -----------------------------------------------------------------------
    def fetch_state(
        self, fragments: Sequence[int] = (), held: Mapping[int, np.ndarray] | None = None
    ) -> list[GlobalFragment]:
        """The current global value of `fragments` (all if empty), over the unary stream;
        the caller adopts them (they count as known). A fragment in `held` whose current value
        is that array (same checksum) is not sent again: the held array comes back instead."""
        out = self._fetch(fragments, held or {})
        for g in out:
            self.known_versions[g.fragment] = max(
                self.known_versions.get(g.fragment, -1), g.version
            )
        return out

    def _fetch(
        self, fragments: Sequence[int], held: Mapping[int, np.ndarray] | None = None
    ) -> list[GlobalFragment]:
        assert self._channel is not None, "connect() first"
        mine = {p: np.ascontiguousarray(v, "<f4") for p, v in (held or {}).items()}
        fetch = self._method("unary_stream", "FetchState", fragment_pb2.GlobalFragmentChunk)
        request = synchronizer_pb2.FetchStateRequest(
            job=self.job,
            fragments=list(fragments),
            held={p: codecs.checksum(v.tobytes()) for p, v in mine.items()},
        )
        out: list[GlobalFragment] = []
        assembler = ChunkAssembler()
        for chunk in fetch(request, timeout=120):
            p = chunk.header.fragment
            if chunk.unchanged and p in mine:
                out.append(GlobalFragment(p, chunk.version, mine[p].copy()))
                continue
            got = self._assemble(assembler, chunk)
            if got is not None:
                out.append(got)
        for g in out:
            self._hold(g)
        return out

    # --- the session thread -------------------------------------------------------------
    def _method(self, kind: str, name: str, response: Any) -> Any:
        """A call of the synchronizer service whose messages count their bytes on the way."""
        return getattr(self._channel, kind)(
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
                token=self.token,
                params=[
                    fragment_pb2.TensorSpec(name=p.name, shape=p.shape, dtype=p.dtype)
                    for p in self.params
                ],
                step=self.step,
            )
        )

    def _run(self) -> None:
        delays = backoff_delays(max_s=self.max_backoff_s, initial_s=min(1.0, self.max_backoff_s))
        first = True
        while not self._closed.is_set():
            address = next(self._address_cycle)
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
            finally:
                self._connected.clear()
            if self._closed.is_set():
                return
            first = False
            self.stats.reconnects += 1
            self._closed.wait(next(delays))

    def _session(self, address: str, first: bool) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = grpc.insecure_channel(address, options=channel_options(self.max_backoff_s))
        session = self._method("stream_stream", "Session", session_pb2.SynchronizerMessage)
        outbox: queue.Queue[Outbound | None] = queue.Queue()
        outbox.put(self._hello())
        self._outbox = outbox
        responses = session(self._requests(outbox))
        assembler = ChunkAssembler()
        try:
            for message in responses:
                kind = message.WhichOneof("kind")
                if kind == "welcome":
                    self._on_welcome(message.welcome, outbox, first)
                elif kind == "ack":
                    self._on_ack(message.ack, outbox)
                elif kind == "fragment":
                    got = self._assemble(assembler, message.fragment)
                    if got is not None:
                        self._hold(got)
                        self._deliver(got)
                elif kind == "status":
                    self.job_status = message.status
                if self._closed.is_set():
                    break
        finally:
            outbox.put(None)
            responses.cancel()

    def _on_ack(self, ack: session_pb2.Ack, outbox: queue.Queue[Outbound | None]) -> None:
        if ack.code == grpc.StatusCode.UNAVAILABLE.value[0]:
            # The synchronizer could not store it: send it again shortly, same seq.
            def resend() -> None:
                # Under the lock that send_update holds: one update's chunks never interleave
                # with another's on the stream.
                with self._lock:
                    out = self._unacked.get(ack.seq)
                    if out is not None and not self._closed.is_set():
                        for message in out.messages:
                            outbox.put(message)

            timer = threading.Timer(RESEND_DELAY_S, resend)
            timer.daemon = True
            timer.start()
            return
        with self._lock:
            self.stats.acks[ack.seq] = ack
            self._unacked.pop(ack.seq, None)
            self._lock.notify_all()

    def _on_welcome(
        self,
        welcome: session_pb2.Welcome,
        outbox: queue.Queue[Outbound | None],
        first: bool,
    ) -> None:
        self.welcome = welcome
        with self._lock:
            pending = [self._unacked[s] for s in sorted(self._unacked)]
            for out in pending:
                for message in out.messages:
                    outbox.put(message)
        if not first:
            tm.REJOINS.inc()
            moved = [
                p for p, v in enumerate(welcome.versions) if v > self.known_versions.get(p, -1)
            ]
            log.info(
                "reconnected",
                synchronizer=welcome.synchronizer_id,
                resent=len(pending),
                moved=len(moved),
            )
            if moved and welcome.initialized:
                for g in self.fetch_state(moved):
                    self.fragments.put(g)
        self._connected.set()

    @property
    def job_finished(self) -> bool:
        """The job's step budget is spent: finish now (final sync), whatever --steps says."""
        return self.job_status is not None and self.job_status.finish

    def _assemble(
        self, assembler: ChunkAssembler, chunk: fragment_pb2.GlobalFragmentChunk
    ) -> GlobalFragment | None:
        """A whole global value from its chunks: sent whole, or rebuilt from a delta onto the
        value held (a delta that does not follow it brings a whole copy instead)."""
        payload = assembler.feed(chunk.header, chunk.chunk_index, chunk.data)
        if payload is None:
            return None
        p = chunk.header.fragment
        if not chunk.delta:
            return GlobalFragment(p, chunk.version, np.frombuffer(payload, "<f4").copy())
        held = self._canonical.get(p)
        if held is not None and held[0] >= chunk.version:
            return None  # already held (a whole copy overtook this delta)
        if held is None or held[0] != chunk.base_version:
            log.info("delta_gap", fragment=p, held=held and held[0], base=chunk.base_version)
            fetched = self._fetch([p])  # delivered by the caller, like a pushed value
            return fetched[0] if fetched else None
        codec = codecs.by_wire(chunk.header.codec)
        values = apply_delta(held[1], payload, codec, chunk.header.block_size)
        return GlobalFragment(p, chunk.version, values)

    def _hold(self, got: GlobalFragment) -> None:
        held = self._canonical.get(got.fragment)
        if held is None or got.version > held[0]:
            self._canonical[got.fragment] = (got.version, got.values)

    def _deliver(self, got: GlobalFragment) -> None:
        if got.version <= self.known_versions.get(got.fragment, -1):
            return
        self.known_versions[got.fragment] = got.version
        self.fragments.put(got)
