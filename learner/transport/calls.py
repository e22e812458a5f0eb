"""How the learner's calls reach the synchronizer replicas: channels, credentials, byte
counts, and what a failed call means.

Owns the session's channel (replaced by the session thread at each reconnect) and one
channel per owner, by the address this learner reaches it at (`routes`); any thread opens
and reads them, under its lock. When the connection to an owner drops, `on_lost` is told
(the ingest sends again what only that owner had received).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from services import telemetry as tm
from services.gen.atoll.v1 import session_pb2, synchronizer_pb2
from services.grpcopts import channel_options, target_host
from services.wirecount import counting_parser, counting_serializer

SERVICE = synchronizer_pb2.DESCRIPTOR.services_by_name["Synchronizer"].full_name

FATAL = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ABORTED,
}


class SessionError(RuntimeError):
    """The synchronizer refused the session for a reason retrying will not fix, or no
    synchronizer answered for longer than the learner was told to wait (`give_up_s`)."""


def status(err: BaseException) -> grpc.StatusCode | None:
    """A failed gRPC call's status code (None for any other error)."""
    code = getattr(err, "code", None) if isinstance(err, grpc.RpcError) else None
    return code() if callable(code) else None


def retryable(err: BaseException) -> bool:
    """Whether a failed call may succeed when tried again: any failure but a refusal (a
    call on a channel the session just replaced raises ValueError; so does a value that
    arrived garbled)."""
    return status(err) not in FATAL


def describe(err: BaseException) -> str:
    """A failure in a word for the logs: its status code, else its message."""
    code = status(err)
    return str(code) if code is not None else str(err)


@dataclass(frozen=True)
class Identity:
    """Who speaks: a learner slot's incarnation in a job."""

    job: str
    learner_id: str
    incarnation: str

    def bind_log_context(self) -> None:
        """This thread's log lines name the learner slot, its incarnation and job."""
        structlog.contextvars.bind_contextvars(
            learner=self.learner_id, incarnation=self.incarnation, job=self.job
        )


@dataclass
class ClientStats:
    bytes_up: int = 0
    bytes_down: int = 0
    reconnects: int = 0
    acks: dict[int, session_pb2.Ack] = field(default_factory=dict)  # final acks by seq
    received: int = 0  # RECEIVED acks, resends included


def _serialize(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class Channels:
    """The learner's channels to the synchronizer replicas, and the calls made on them."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        token: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        max_backoff_s: float = 5.0,
        routes: Mapping[str, str] | None = None,
        tls_server_name: str = "",
    ) -> None:
        if not addresses:
            raise ValueError("give at least one synchronizer address HOST:PORT")
        self.addresses = list(addresses)
        self.routes = dict(routes or {})
        self.credentials = credentials
        self.tls_server_name = tls_server_name or target_host(self.addresses[0])
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self.max_backoff_s = max_backoff_s
        self.stats = ClientStats()
        self.session: grpc.Channel | None = None  # the session's (or a data path's) channel
        self.on_lost: Callable[[str], None] = lambda address: None
        self._owners: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def method(
        self, kind: str, name: str, response: Any, channel: grpc.Channel | None = None
    ) -> Any:
        """A call of the synchronizer service whose messages count their bytes on the way,
        over `channel` (default: the session's)."""
        return getattr(channel or self.session, kind)(
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

    def reached_at(self, address: str) -> str:
        """Where this learner reaches a replica that advertises `address` (`routes`)."""
        return self.routes.get(address, address)

    def owner(self, address: str) -> grpc.Channel:
        """The channel to an owner, by the address it is reached at."""
        with self._lock:
            channel = self._owners.get(address)
            if channel is None:
                channel = self.open(address, owner=True)
                self._owners[address] = channel
                self._watch(address, channel)
            return channel

    def open(self, address: str, owner: bool = False) -> grpc.Channel:
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
        """Tell `on_lost` when a connection to an owner that was up drops."""
        connected = False

        def changed(state: grpc.ChannelConnectivity) -> None:
            nonlocal connected
            if state == grpc.ChannelConnectivity.READY:
                connected = True
                return
            if connected:
                connected = False
                self.on_lost(address)

        channel.subscribe(changed, try_to_connect=False)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        with self._lock:
            channels = list(self._owners.values())
        for channel in channels:
            channel.close()
