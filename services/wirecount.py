"""Counting bytes on the wire where they are made: at (de)serialization.

Wrapping a message's serializer and parser gives the exact size of every message for free
(asking a parsed message for its size would serialize it once more). The count includes
gRPC's 5-byte length prefix per message; HTTP/2 framing is below what a service can see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

GRPC_FRAME_OVERHEAD = 5
M = TypeVar("M")


def counting_serializer(
    serialize: Callable[[M], bytes], count: Callable[[int], None]
) -> Callable[[M], bytes]:
    def wrapped(message: M) -> bytes:
        data = serialize(message)
        count(len(data) + GRPC_FRAME_OVERHEAD)
        return data

    return wrapped


def passing_bytes(serialize: Callable[[M], bytes]) -> Callable[[M | bytes], bytes]:
    """`serialize`, except for a message serialized already (bytes), which passes as it is."""

    def wrapped(message: M | bytes) -> bytes:
        return message if isinstance(message, bytes) else serialize(message)

    return wrapped


def counting_parser(
    parse: Callable[[bytes], Any], count: Callable[[int], None]
) -> Callable[[bytes], Any]:
    def wrapped(data: bytes) -> Any:
        count(len(data) + GRPC_FRAME_OVERHEAD)
        return parse(data)

    return wrapped
