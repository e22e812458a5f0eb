"""Sending updates: each goes, chunk by chunk, to the replica that owns its fragment (an
Ingest call, as synchronizer/ingest.py takes it).

Owns the updates not yet committed: each is kept until its owner says it is committed (or
refuses it); if the owner changes first (its epoch moves), or the connection to the owner
that had received it drops, it is sent again to the owner of now, which deduplicates it.
Threads: any thread queues an update (`send`) and never waits; INGEST_CALLS ingest threads
send them, a failed send waiting its own backoff; the session thread settles final acks and
hands on the owner map. All under one condition.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import structlog

from learner.transport.calls import Channels, Identity, status
from services.codec import Segment
from services.gen.atoll.v1 import fragment_pb2, session_pb2
from services.grpcopts import backoff_delays
from services.wire import DEFAULT_MAX_CHUNK_BYTES, segments_header

log = structlog.get_logger("atoll.learner.client")
INGEST_TIMEOUT_S = 120.0
NO_OWNER_WAIT_S = 0.2
INGEST_CALLS = 4  # updates on their way to owners at once (each its own Ingest call)


@dataclass(eq=False)
class Outgoing:
    """An update kept until committed (or refused, or, for initial values, taken)."""

    seq: int
    fragment: int
    chunks: list[session_pb2.UpdateChunk]
    received_epoch: int | None = None  # the owner epoch it was received under
    received_at: str = ""  # the address of the owner that received it
    retries: Iterator[float] | None = None  # delays between failed sends (backoff)
    not_before: float = 0.0  # monotonic time of its next send after a failed one


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


class Ingest:
    """The updates of one learner incarnation on their way."""

    def __init__(
        self,
        channels: Channels,
        identity: Identity,
        closed: threading.Event,
        check: Callable[[], None],
    ) -> None:
        """`closed`: the client closed; `check`: raises once the session failed for good."""
        self.channels, self.identity = channels, identity
        self.closed, self.check = closed, check
        self.owners: dict[int, session_pb2.FragmentOwner] = {}
        self._seq = itertools.count(1)
        self._lock = threading.Condition()
        self._unacked: dict[int, Outgoing] = {}
        self._sending: set[int] = set()  # seqs on an Ingest call now
        self._threads: list[threading.Thread] = []
        channels.on_lost = self._owner_lost

    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._run, name=f"atoll-ingest-{i}", daemon=True)
            for i in range(INGEST_CALLS)
        ]
        for thread in self._threads:
            thread.start()

    def join(self) -> None:
        """Wake the ingest threads (the client is closed) and wait for them."""
        with self._lock:
            self._lock.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)

    # --- what the caller and the session do -----------------------------------------------
    def send(
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
                learner_id=self.identity.learner_id,
                incarnation=self.identity.incarnation,
                part=part,
                parts=parts,
            )
            chunk.header.CopyFrom(header)
            if i == 0:
                chunk.tensor_norms.extend(tensor_norms)
            chunks.append(chunk)
        with self._lock:
            self._unacked[seq] = Outgoing(seq, fragment, chunks)
            self._lock.notify_all()
        return seq

    def send_initial(self, fragment: int, values: np.ndarray) -> int:
        """Queue a fragment of the job's initial parameters (float32, kind INITIAL)."""
        flat = np.ascontiguousarray(values, "<f4")
        return self.send(
            fragment=fragment,
            payload=flat.tobytes(),
            codec=fragment_pb2.CODEC_FP32,
            block_size=0,
            num_elements=flat.size,
            kind=session_pb2.UPDATE_KIND_INITIAL,
        )

    def raw(self, chunks: Sequence[session_pb2.UpdateChunk]) -> session_pb2.Ack:
        """Send hand-built chunks as they are to their fragment's owner (protocol tests)."""
        fragment = chunks[0].header.fragment
        deadline = time.monotonic() + 30
        while not self.owners:
            if time.monotonic() > deadline:
                raise TimeoutError("no fragment owner is known")
            time.sleep(0.05)
        # A fragment that does not exist has no owner: any replica refuses it.
        owner = self.owners.get(fragment) or next(iter(self.owners.values()))
        call = self._call(owner.address)
        ack: session_pb2.Ack = call(
            iter(chunks), timeout=INGEST_TIMEOUT_S, metadata=self.channels.metadata
        )
        return ack

    def set_owners(self, owners: dict[int, session_pb2.FragmentOwner]) -> None:
        """The owner map, as the session told it: updates go to the owners of now. A failed
        send's backoff waited for the old owner: a new one is tried at once."""
        with self._lock:
            before, self.owners = self.owners, owners
            for out in self._unacked.values():
                old, new = before.get(out.fragment), owners.get(out.fragment)
                if new is not None and (
                    old is None or (old.epoch, old.address) != (new.epoch, new.address)
                ):
                    out.retries, out.not_before = None, 0.0
            self._lock.notify_all()

    def resend(self) -> int:
        """Commit notices may have gone by while the session was away: ask each owner
        again; returns how many updates are kept."""
        with self._lock:
            for out in self._unacked.values():
                out.received_epoch = None
            self._lock.notify_all()
            return len(self._unacked)

    def _owner_lost(self, address: str) -> None:
        """The connection to an owner dropped: the updates it had only received may have
        died with its round (a killed replica, a lost lease): they are sent again at once,
        without waiting for the session to bring the new owner map (which takes a lease when
        the session's replica died too). An owner that still holds one answers `received`."""
        with self._lock:
            for out in self._unacked.values():
                if out.received_at == address:
                    out.received_epoch = None
            self._lock.notify_all()

    def settle(self, ack: session_pb2.Ack) -> None:
        """An update's final ack, as the session (of this or another process) got it."""
        with self._lock:
            if ack.seq in self._unacked:
                del self._unacked[ack.seq]
                self.channels.stats.acks[ack.seq] = ack
                self._lock.notify_all()

    def final_acks(self) -> dict[int, session_pb2.Ack]:
        """The final acks so far, by seq (a copy)."""
        with self._lock:
            return dict(self.channels.stats.acks)

    def unacked(self) -> int:
        """Updates not committed (or refused) yet."""
        with self._lock:
            return len(self._unacked)

    def kept(self) -> list[Outgoing]:
        """The updates kept until committed (a copy of the list)."""
        with self._lock:
            return list(self._unacked.values())

    def wait_ack(self, seq: int, timeout: float, received: bool = False) -> session_pb2.Ack:
        """Wait for an update's final ack (or, with `received`, for its owner to have it)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                self.check()
                if seq in self.channels.stats.acks:
                    return self.channels.stats.acks[seq]
                out = self._unacked.get(seq)
                if received and out is not None and out.received_epoch is not None:
                    return session_pb2.Ack(
                        seq=seq, status=session_pb2.ACK_STATUS_RECEIVED, epoch=out.received_epoch
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no ack for update {seq} within {timeout:.1f} s")
                self._lock.wait(min(left, 0.5))

    # --- the ingest threads ---------------------------------------------------------------
    def _call(self, address: str) -> Any:
        """An Ingest call to the owner that advertises `address`."""
        channel = self.channels.owner(self.channels.reached_at(address))
        return self.channels.method("stream_unary", "Ingest", session_pb2.Ack, channel)

    def _next_to_send(self) -> tuple[Outgoing, session_pb2.FragmentOwner] | None:
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

    def _failed(self, out: Outgoing) -> None:
        """A send of `out` failed: it waits its next backoff delay (under lock). The delay is
        the update's own, so the ingest threads do not take turns retrying it at once."""
        if out.retries is None:
            out.retries = backoff_delays(max_s=self.channels.max_backoff_s, initial_s=0.1)
        out.not_before = time.monotonic() + next(out.retries)
        self._sending.discard(out.seq)

    def _run(self) -> None:
        self.identity.bind_log_context()
        while not self.closed.is_set():
            with self._lock:
                picked = self._next_to_send()
                if picked is None:
                    self._lock.wait(NO_OWNER_WAIT_S)
                    continue
                out, owner = picked
                self._sending.add(out.seq)
                call = self._call(owner.address)
            try:
                ack = call(
                    iter(out.chunks), timeout=INGEST_TIMEOUT_S, metadata=self.channels.metadata
                )
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
                    self.channels.stats.received += 1
                    current = self._unacked.get(out.seq)
                    if current is not None:
                        current.received_epoch = ack.epoch
                        current.received_at = self.channels.reached_at(owner.address)
                        self._lock.notify_all()
                else:
                    self.settle(ack)
