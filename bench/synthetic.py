"""A synthetic learner of `atoll bench scale` (`atoll bench scale-learner`, one process
each): a control session that heartbeats as a real learner does and follows every replica,
counting the new values pushed without decoding them, and `--calls` senders streaming one
pre-encoded update to each fragment's owner, each fragment sent again once its last update
merged. It writes what it sent, what was received and when, as JSON."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
from pydantic import BaseModel, Field

from services import codec as codecs
from services.gen.atoll.v1 import fragment_pb2, session_pb2, synchronizer_pb2
from services.grpcopts import channel_options
from services.layout import LeafSpec
from services.wire import segments_header


class ScaleLearner(BaseModel):
    """internal: one synthetic learner of `atoll bench scale`"""

    addresses: str = Field(
        description="synchronizer addresses, comma separated; the session goes to the one at "
        "index mod their count, updates to each fragment's owner"
    )
    index: int = Field(0, description="this learner's number")
    params: int = Field(description="model parameters")
    fragments: int = Field(description="P")
    update: Path = Field(description="the pre-encoded update (packed segments)")
    seconds: float = Field(description="how long to stream")
    result: Path = Field(description="where to write the result JSON")
    codec: str = Field("int4", description="codec the update was encoded with")
    calls: int = Field(1, ge=1, description="Ingest calls in flight at once")

    def cli_cmd(self) -> None:
        run_learner(self)


SERVICE = synchronizer_pb2.DESCRIPTOR.services_by_name["Synchronizer"].full_name
LEAVES_PER_FRAGMENT = 4


def model_spec(params: int, fragments: int) -> list[LeafSpec]:
    """P x 4 equal leaves: the layout puts 4 in each fragment."""
    leaves = fragments * LEAVES_PER_FRAGMENT
    size = max(1, params // leaves)
    return [LeafSpec(f"blocks/{i}/w", (size,)) for i in range(leaves)]


def static_chunks(
    fragment: int,
    segments: list[codecs.Segment],
    codec: codecs.Codec,
    *,
    learner: str = "",
    incarnation: str = "",
) -> list[bytes]:
    """An update's chunks serialized once. The fields each send changes (seq, base version,
    a learner id of its own) are serialized on their own and appended: protobuf merges
    concatenated messages, the later field winning."""
    header = segments_header(fragment, codec.wire, 256, sum(s.count for s in segments), segments)
    return [
        session_pb2.UpdateChunk(
            header=header,
            kind=session_pb2.UPDATE_KIND_OUTER_GRADIENT,
            chunk_index=i,
            data=bytes(s.data),  # encoded here: bytes already, not copied
            value_offset=s.offset,
            value_count=s.count,
            c_steps=10,
            c_tokens=1000,
            compute_seconds=1.0,
            learner_id=learner,
            incarnation=incarnation,
        ).SerializeToString()
        for i, s in enumerate(segments)
    ]


class _Session:
    """A learner's control session, and its Follow call to each replica of the owner map,
    reading every new value pushed (counting, not decoding)."""

    def __init__(self, address: str, spec: list[LeafSpec], learner: str) -> None:
        self.channel = grpc.insecure_channel(address, options=channel_options(1.0))
        self.owners: dict[int, str] = {}
        self.versions: dict[int, int] = {}
        self.seen_at: dict[tuple[int, int], float] = {}  # (fragment, version): first chunk
        self.bytes_down = 0
        self.ready = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._following: dict[str, grpc.Channel] = {}
        self.learner = learner
        self._hello = session_pb2.LearnerMessage(
            hello=session_pb2.Hello(
                job="default",
                learner_id=learner,
                incarnation=uuid.uuid4().hex,
                params=[
                    fragment_pb2.TensorSpec(name=s.name, shape=s.shape, dtype=s.dtype) for s in spec
                ],
            )
        )
        threading.Thread(target=self._run, daemon=True).start()

    def _requests(self) -> Any:
        yield self._hello
        started = time.monotonic()
        step = 0
        while not self._closed.wait(1.0):
            step += 10
            yield session_pb2.LearnerMessage(
                heartbeat=session_pb2.Heartbeat(
                    step=step,
                    step_time_ema_s=0.1,
                    tokens_per_s=step / (time.monotonic() - started),
                    loss=1.0,
                    eval_loss=float("nan"),
                )
            )

    def _run(self) -> None:
        call = self.channel.stream_stream(
            f"/{SERVICE}/Session",
            request_serializer=session_pb2.LearnerMessage.SerializeToString,
            response_deserializer=session_pb2.SynchronizerMessage.FromString,
        )
        for message in call(self._requests()):
            kind = message.WhichOneof("kind")
            if kind in ("welcome", "owners"):
                owners = message.welcome.owners if kind == "welcome" else message.owners.owners
                self.owners = {o.fragment: o.address for o in owners}
                for address in set(self.owners.values()) - set(self._following):
                    channel = grpc.insecure_channel(address, options=channel_options(1.0))
                    self._following[address] = channel
                    threading.Thread(target=self._follow, args=(channel,), daemon=True).start()
                self.ready.set()
            if self._closed.is_set():
                return

    def _follow(self, channel: grpc.Channel) -> None:
        """New values of the fragments a replica owns, from the versions seen (the bench's
        replicas keep their fragments: one call, for as long as the bench runs)."""
        follow = channel.unary_stream(
            f"/{SERVICE}/Follow",
            request_serializer=synchronizer_pb2.FollowRequest.SerializeToString,
            response_deserializer=session_pb2.SynchronizerMessage.FromString,
        )
        request = synchronizer_pb2.FollowRequest(
            job="default", held=dict(self.versions), learner_id=self.learner
        )
        with contextlib.suppress(grpc.RpcError):  # the replica stops at the bench's end
            for message in follow(request):
                chunk = message.fragment
                p = chunk.header.fragment
                with self._lock:
                    self.bytes_down += len(chunk.data)
                    if chunk.version > self.versions.get(p, 0):
                        self.seen_at[(p, chunk.version)] = time.time()
                    self.versions[p] = max(self.versions.get(p, 0), chunk.version)
                if self._closed.is_set():
                    return

    def close(self) -> None:
        self._closed.set()
        self.channel.close()
        for channel in self._following.values():
            channel.close()


class _Fragments:
    """Which fragment a learner's sender takes next: round robin from the learner's own
    start, skipping those another of its senders is sending (one update of a learner per
    fragment at a time, as its client sends)."""

    def __init__(self, start: int, count: int, versions: dict[int, int]) -> None:
        self.next, self.count = start, count
        self.busy: set[int] = set()
        self.versions = versions  # the newest version of each fragment the session saw
        self.after: dict[int, int] = {}  # sent again once its version passes this
        self.lock = threading.Lock()

    def take(self) -> int | None:
        with self.lock:
            for _ in range(self.count):
                p, self.next = self.next, (self.next + 1) % self.count
                if p not in self.busy and self.versions.get(p, 0) > self.after.get(p, -1):
                    self.busy.add(p)
                    return p
            return None

    def give_back(self, p: int, received_at: int | None) -> None:
        """`received_at`: the fragment's version when its owner received the update (its
        next update waits until that one merged), None if it was not received."""
        with self.lock:
            self.busy.discard(p)
            if received_at is not None:
                self.after[p] = received_at


def run_learner(settings: ScaleLearner) -> None:
    spec = model_spec(settings.params, settings.fragments)
    segments = codecs.unpack_segments(settings.update.read_bytes())
    codec = codecs.by_name(settings.codec)
    payload = sum(len(s.data) for s in segments)
    learner = f"bench-{settings.index}"
    # Sessions spread over the replicas as a Service spreads them (new values come from
    # each fragment's owner, on the learner's Follow calls).
    addresses = settings.addresses.split(",")
    session = _Session(addresses[settings.index % len(addresses)], spec, learner)
    session.ready.wait(30)
    incarnation = session._hello.hello.incarnation
    static = {
        p: static_chunks(p, segments, codec, learner=learner, incarnation=incarnation)
        for p in range(settings.fragments)
    }
    channels: dict[str, Any] = {}
    lock = threading.Lock()
    counts = {"sent": 0, "received": 0, "seq": 0}
    calls: list[float] = []
    refused: dict[str, int] = {}  # calls that failed, by status code
    # (fragment, version received at, when): how long each update's fragment then took to
    # show its learner a newer version (its merge, and the push of its delta).
    received: list[tuple[int, int, float]] = []
    fragments = _Fragments(
        settings.index % settings.fragments, settings.fragments, session.versions
    )
    started = time.monotonic()
    deadline = started + settings.seconds

    def send(p: int) -> int | None:
        """Send an update of fragment `p`; the version its owner received it at, if it did."""
        address = session.owners.get(p)
        if address is None:
            time.sleep(0.05)
            return None
        with lock:
            if address not in channels:
                channels[address] = grpc.insecure_channel(address, options=channel_options(1.0))
            counts["seq"] += 1
            seq = counts["seq"]
        call = channels[address].stream_unary(
            f"/{SERVICE}/Ingest",
            request_serializer=None,
            response_deserializer=session_pb2.Ack.FromString,
        )
        tail = session_pb2.UpdateChunk(
            seq=seq, base_version=session.versions.get(p, 0)
        ).SerializeToString()
        began = time.monotonic()
        try:
            ack = call(iter([c + tail for c in static[p]]), timeout=120)
        except grpc.RpcError as err:
            with lock:
                code = err.code().name if hasattr(err, "code") else "UNKNOWN"
                refused[code] = refused.get(code, 0) + 1
            time.sleep(0.1)
            return None
        with lock:
            calls.append(round(time.monotonic() - began, 4))
            counts["sent"] += 1
            if ack.status != session_pb2.ACK_STATUS_RECEIVED:
                return None
            counts["received"] += 1
            received.append((p, int(ack.version), time.time()))
            return int(ack.version)

    def sender() -> None:
        while time.monotonic() < deadline:
            p = fragments.take()
            if p is None:
                time.sleep(0.05)
                continue
            received_at = None
            try:
                received_at = send(p)
            finally:
                fragments.give_back(p, received_at)

    senders = [threading.Thread(target=sender, daemon=True) for _ in range(settings.calls)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join()
    elapsed = time.monotonic() - started
    session.close()
    seen = [(p, v, at) for (p, v), at in sorted(session.seen_at.items())]
    settings.result.write_text(
        json.dumps(
            {
                "bytes": counts["received"] * payload,
                "received": counts["received"],
                "sent": counts["sent"],
                "seconds": elapsed,
                "bytes_down": session.bytes_down,
                "calls_s": calls,
                "refused": refused,
                # [fragment, version, wall-clock time]: updates received (at that version)
                # and each version's first chunk seen, to compare with the commit log.
                "received_at": received,
                "seen_at": seen,
                "cpu_s": time.process_time(),  # every thread of this process, gRPC's too
            }
        )
    )
