"""gRPC options both services use: message limits, keepalive, reconnect backoff, addresses."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

# Payloads travel in chunks of at most 4 MiB; the limit leaves room for the envelope.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024

# gRPC's connection-backoff numbers: 1 s initial, x1.6, +-20 % jitter, 120 s cap.
BACKOFF_INITIAL_S = 1.0
BACKOFF_MULTIPLIER = 1.6
BACKOFF_JITTER = 0.2
BACKOFF_MAX_S = 120.0

_COMMON: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


# Streams one connection may have open at once: a learner needs a session, an Ingest call
# and a state fetch or two; what one connection can hold in flight is this times a message.
MAX_STREAMS_PER_CONNECTION = 100
# A connection that has not finished its TLS handshake this long after it opened is closed
# (gRPC's default is 120 s: 150 connections that never started one stayed open).
HANDSHAKE_TIMEOUT_S = 10


def server_options() -> list[tuple[str, int]]:
    return [
        *_COMMON,
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_S * 1000),
    ]


def channel_options(max_backoff_s: float = BACKOFF_MAX_S) -> list[tuple[str, int]]:
    return [
        *_COMMON,
        ("grpc.initial_reconnect_backoff_ms", int(BACKOFF_INITIAL_S * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(max_backoff_s * 1000)),
        ("grpc.enable_retries", 1),
    ]


def backoff_delays(
    *,
    initial_s: float = BACKOFF_INITIAL_S,
    multiplier: float = BACKOFF_MULTIPLIER,
    jitter: float = BACKOFF_JITTER,
    max_s: float = BACKOFF_MAX_S,
    rng: random.Random | None = None,
) -> Iterator[float]:
    """Delays between reconnect attempts: exponential with jitter, capped (endless)."""
    rng = rng or random.Random()
    current = initial_s
    while True:
        yield min(max_s, current) * (1.0 + rng.uniform(-jitter, jitter))
        current = min(max_s, current * multiplier)


def split_hostport(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")
    return host.strip("[]"), int(port)


def bind_error(listen: str) -> OSError | None:
    """Why HOST:PORT cannot be listened on now (the port in use, the address not this
    machine's), or None; port 0 (any free one) always can. Asked before a server binds, so
    the user reads one line naming the flag, not a bind failure deep in a library."""
    host, port = split_hostport(listen)
    if port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as err:  # socket.gaierror is one
        return err
    return None


def cannot_listen(flag: str, listen: str, err: BaseException) -> str:
    """The one line that says a listener's address cannot be had, and what to do."""
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return (
        f"cannot listen on {flag} {listen}: {reason.lower()}; choose a free port, or stop "
        "the process that holds it"
    )


def target_host(target: str) -> str:
    """The host name a secure channel to `target` checks the server's certificate against,
    as gRPC takes it from the target: `HOST:PORT`, `[V6]:PORT`, `dns:[//AUTHORITY]/HOST:PORT`,
    `ipv4:ADDR:PORT` and `ipv6:[ADDR]:PORT` (the first of a list). "" for a target that
    names no host (`unix:`, `unix-abstract:`, `vsock:`)."""
    scheme, sep, rest = target.partition(":")
    if sep and scheme in ("unix", "unix-abstract", "vsock"):
        return ""
    if sep and scheme == "dns":
        rest = rest.removeprefix("//").partition("/")[2] if rest.startswith("//") else rest
        target = rest.lstrip("/")
    elif sep and scheme in ("ipv4", "ipv6"):
        target = rest.split(",")[0]
    try:
        return split_hostport(target)[0]
    except ValueError:  # no port
        return target.strip("[]")
