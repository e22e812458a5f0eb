"""Which updates the synchronizer admits: pure checks, each refusal with a reason to act on.

Nothing here touches state; a refused update never reaches the store.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from services import codec as codecs
from services.gen.atoll.v1 import fragment_pb2, session_pb2
from services.layout import FragmentLayout


@dataclass(frozen=True)
class Rejection(Exception):
    reason: str  # one of telemetry.REJECT_REASONS
    code: grpc.StatusCode
    message: str

    def __str__(self) -> str:
        return self.message


def _invalid(reason: str, message: str) -> Rejection:
    return Rejection(reason, grpc.StatusCode.INVALID_ARGUMENT, message)


def check_header(
    header: fragment_pb2.PayloadHeader, kind: int, c_steps: int, layout: FragmentLayout
) -> codecs.Codec:
    """Check an update's header against the job's layout; return its codec."""
    if kind not in (session_pb2.UPDATE_KIND_OUTER_GRADIENT, session_pb2.UPDATE_KIND_INITIAL):
        raise _invalid("bad_request", f"update kind {kind} is not one this synchronizer knows")
    if header.fragment >= layout.num_fragments:
        raise _invalid(
            "unknown_fragment",
            f"fragment {header.fragment} does not exist; this job has fragments "
            f"0..{layout.num_fragments - 1}",
        )
    expected = layout.fragments[header.fragment].num_elements
    if header.num_elements != expected:
        raise _invalid(
            "shape_mismatch",
            f"fragment {header.fragment} holds {expected} values, the update announces "
            f"{header.num_elements}: the learner's model or fragment count differs from the job's",
        )
    try:
        codec = codecs.by_wire(header.codec)
    except codecs.CodecError as err:
        raise _invalid("bad_codec", str(err)) from None
    if kind == session_pb2.UPDATE_KIND_INITIAL and codec.name != "fp32":
        raise _invalid("bad_codec", "initial parameters must be sent with the fp32 codec")
    if kind == session_pb2.UPDATE_KIND_OUTER_GRADIENT and c_steps < 1:
        raise _invalid("bad_request", "an outer gradient needs c_steps >= 1 (steps since anchor)")
    return codec


def check_payload(header: fragment_pb2.PayloadHeader, codec: codecs.Codec, payload: bytes) -> None:
    try:
        codec.check(payload, header.num_elements, header.block_size)
    except codecs.CodecError as err:
        non_finite = "NaN" in str(err)
        raise _invalid("non_finite" if non_finite else "bad_codec", str(err)) from None


def check_chunk(
    chunk: session_pb2.UpdateChunk,
    first: session_pb2.UpdateChunk,
    index: int,
    offset: int,
    size: int,
) -> None:
    """Check one chunk of an update against its first chunk and the values already in."""
    if index and (
        chunk.header != first.header
        or chunk.seq != first.seq
        or chunk.kind != first.kind
        or chunk.base_version != first.base_version
    ):
        raise _invalid(
            "out_of_order", "header changed between chunks of one update; resend it whole"
        )
    if chunk.chunk_index != index or chunk.value_offset != offset:
        raise _invalid(
            "out_of_order",
            f"chunk {chunk.chunk_index} at value {chunk.value_offset} arrived out of order: chunk "
            f"{index} at value {offset} was due; send chunks in order",
        )
    count = chunk.value_count
    block = first.header.block_size
    if count < 1 or count > size - offset:
        raise _invalid(
            "shape_mismatch",
            f"chunk {index} holds {count} values from {offset}; the fragment has {size}",
        )
    if block and count % block and offset + count != size:
        raise _invalid(
            "bad_codec",
            f"chunk {index} holds {count} values, not whole blocks of {block}; every chunk "
            "but the last must hold whole blocks",
        )
