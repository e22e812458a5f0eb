"""Which updates the synchronizer admits: pure checks, each refusal with a reason to act on.

Nothing here touches state; a refused update never reaches the store. A refusal carries its
status as a `Status` (gRPC's numbering); the shell turns it into gRPC's own at the edge
(`synchronizer/refusals.py`).
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from services import codec as codecs
from services.config import JobConfig
from services.gen.atoll.v1 import fragment_pb2, session_pb2
from services.layout import FragmentLayout
from services.wire import split_field
from synchronizer.core.merge import token_weight
from synchronizer.core.recent import Recent

DATA_FIELD = session_pb2.UpdateChunk.DESCRIPTOR.fields_by_name["data"].number


class Arrived(NamedTuple):
    """One chunk of an Ingest call: every field but its payload (`chunk.data` is empty),
    and the payload, read where gRPC put it."""

    chunk: session_pb2.UpdateChunk
    data: memoryview


def parse_chunk(message: bytes) -> Arrived:
    """An Ingest call's message as it arrives (the handler's parser)."""
    split = split_field(message, DATA_FIELD)
    if split is None:  # not a chunk as learners send them: parsed whole, as protobuf does
        chunk = session_pb2.UpdateChunk.FromString(message)
        data = memoryview(chunk.data)
        chunk.ClearField("data")
        return Arrived(chunk, data)
    rest, data = split
    return Arrived(session_pb2.UpdateChunk.FromString(rest), data)


class Status(enum.IntEnum):
    """The status a refusal is answered with, numbered as gRPC numbers its status codes."""

    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    UNAVAILABLE = 14


@dataclass(frozen=True)
class Rejection(Exception):
    reason: str  # one of telemetry.REJECT_REASONS
    code: Status
    message: str

    def __str__(self) -> str:
        return self.message


def _invalid(reason: str, message: str) -> Rejection:
    return Rejection(reason, Status.INVALID_ARGUMENT, message)


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
    if not 1 <= header.chunk_count <= max(1, expected):
        raise _invalid(
            "out_of_order", f"chunk_count {header.chunk_count} is out of 1..{max(1, expected)}"
        )
    if header.block_size > codecs.MAX_BLOCK_SIZE:
        raise _invalid("bad_codec", f"block_size {header.block_size} is over the maximum")
    limit = max_payload_bytes(expected, header.block_size, header.chunk_count)
    if header.total_bytes > limit:
        raise _invalid(
            "shape_mismatch",
            f"the update announces {header.total_bytes} bytes; {expected} values encode in "
            f"at most {limit}",
        )
    if kind == session_pb2.UPDATE_KIND_INITIAL and codec.name != "fp32":
        raise _invalid("bad_codec", "initial parameters must be sent with the fp32 codec")
    if kind == session_pb2.UPDATE_KIND_OUTER_GRADIENT and c_steps < 1:
        raise _invalid("bad_request", "an outer gradient needs c_steps >= 1 (steps since anchor)")
    return codec


def codec_refusal(err: codecs.CodecError) -> Rejection:
    """A payload a codec refused, as the update's refusal: NaN or Inf values (the learner
    diverged), or bytes that are not what the header says."""
    return _invalid("non_finite" if "NaN" in str(err) else "bad_codec", str(err))


# The largest magnitude a first value may have: a model's initial parameters are of order 1
# (a LayerNorm's scale, an embedding's entries); values of 3e38 once initialized a job.
MAX_INITIAL_ABS = 1e4


def initial_values(data: codecs.Payload, count: int) -> np.ndarray:
    """A chunk of a fragment's first values (fp32), checked finite and at most
    MAX_INITIAL_ABS in magnitude, or its refusal."""
    try:
        values = codecs.by_name("fp32").decode(data, count, 0)
    except codecs.CodecError as err:
        raise codec_refusal(err) from None
    if not np.isfinite(values).all():
        raise _invalid("non_finite", "first values hold NaN or Inf; send the model's own")
    if values.size and float(np.abs(values).max()) > MAX_INITIAL_ABS:
        raise _invalid(
            "bad_request",
            f"first values up to {float(np.abs(values).max()):.3g} in magnitude, over "
            f"{MAX_INITIAL_ABS:g}: not a model's initial parameters; send the model's own",
        )
    return values


def _continues(chunk: session_pb2.UpdateChunk, first: session_pb2.UpdateChunk) -> bool:
    """Whether a later chunk carries its call's first chunk's header and update."""
    return (
        chunk.header == first.header
        and chunk.seq == first.seq
        and chunk.kind == first.kind
        and chunk.base_version == first.base_version
        and chunk.learner_id == first.learner_id
        and chunk.incarnation == first.incarnation
    )


def check_chunk(
    chunk: session_pb2.UpdateChunk,
    first: session_pb2.UpdateChunk,
    index: int,
    offset: int,
    size: int,
) -> None:
    """Check one chunk of an update against its first chunk and the values already in."""
    if index and not _continues(chunk, first):
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


MAX_PARTS = 256  # processes one learner's update may come from


def check_parts(chunk: session_pb2.UpdateChunk, size: int, whole_only: str | None) -> None:
    """An update in parts: its part number, and a merge rule that can sum it part by part.
    `whole_only`: the name of the job's merge rule where it cannot (None: it can, or the
    update is first values)."""
    if not 1 < chunk.parts <= min(MAX_PARTS, max(1, size)) or chunk.part >= chunk.parts:
        raise _invalid(
            "bad_request",
            f"part {chunk.part} of {chunk.parts}: an update comes in 2..{MAX_PARTS} parts (at "
            "most one per value), numbered from 0",
        )
    if whole_only is not None:
        raise _invalid(
            "bad_request",
            f"the job's {whole_only} merge takes each update whole (radial merging divides "
            "each tensor by its whole norm before summing it), which an update in parts (a "
            "learner of several processes) cannot give with its first chunk; run the job "
            "with --merge mean",
        )


def check_part_chunk(
    chunk: session_pb2.UpdateChunk,
    first: session_pb2.UpdateChunk,
    index: int,
    after: int,
    size: int,
) -> None:
    """One chunk of one part, against the part's first chunk and its chunks before: in
    order, past the values already in (`after`), inside the fragment. Unlike a whole
    update's, a part's chunks may leave values out (other parts hold them) and end
    mid-block (where the part's range ends)."""
    if index and (
        not _continues(chunk, first) or (chunk.part, chunk.parts) != (first.part, first.parts)
    ):
        raise _invalid(
            "out_of_order", "header changed between chunks of one part; resend the part whole"
        )
    if chunk.chunk_index != index or chunk.value_offset < after:
        raise _invalid(
            "out_of_order",
            f"chunk {chunk.chunk_index} at value {chunk.value_offset} arrived out of order: "
            f"chunk {index} at value {after} or later was due; send a part's chunks in order",
        )
    if chunk.value_count < 1 or chunk.value_count > size - chunk.value_offset:
        raise _invalid(
            "shape_mismatch",
            f"chunk {index} holds {chunk.value_count} values from {chunk.value_offset}; the "
            f"fragment has {size}",
        )


def check_same_update(part: session_pb2.UpdateChunk, first: session_pb2.UpdateChunk) -> None:
    """Every part of one update carries the same counters, codec and part count (the
    compute seconds each process measured may differ: the first part's count)."""
    if (
        part.parts != first.parts
        or part.kind != first.kind
        or part.base_version != first.base_version
        or part.c_steps != first.c_steps
        or part.c_tokens != first.c_tokens
        or part.header.codec != first.header.codec
        or part.header.block_size != first.header.block_size
    ):
        raise _invalid(
            "bad_request",
            f"part {part.part} of update {part.seq} disagrees with part {first.part} on the "
            "update's counters, codec or part count; every part must carry the same",
        )


# --- ranges of every field a learner sends -------------------------------------------------
MAX_LEAVES = 100_000  # leaves of a model spec in a hello
MAX_HELLO_BYTES = 4 << 20
MAX_SPEC_VALUES = 1 << 40  # values of a model spec, all leaves together (4 TiB in float32)
MAX_NAME_CHARS = 256  # job, learner ids, incarnations
MAX_LEAF_NAME_CHARS = 1024
MAX_RANK = 16
MAX_LEAF_VALUES = 1 << 40
MAX_C_STEPS = 10**9
MAX_C_TOKENS = 10**15
MAX_COMPUTE_SECONDS = 1e6
MAX_STEP = 2**53  # exact in a double (Redis's Lua numbers)
MAX_STEP_TIME_S = 3600.0


def _finite_in(value: float, low: float, high: float) -> bool:
    return math.isfinite(value) and low <= value <= high


def check_job(asked: str, served: str) -> None:
    """A call's job against the one this replica serves (raises Rejection)."""
    if asked != served:
        raise Rejection(
            "bad_request",
            Status.FAILED_PRECONDITION,
            f"this synchronizer serves job {served!r}, not {asked[:MAX_NAME_CHARS]!r}; check --job",
        )


def check_fragments_named(
    what: str, fragments: int, maps: Sequence[Collection[int]], named: Iterable[int]
) -> None:
    """A state fetch's or a follow's fragments (raises Rejection): each of `maps` (its
    fields keyed or listed by fragment) names at most the job's `fragments`, and every
    fragment in `named` exists. The sizes are checked first: a fragment list is sorted only
    once it is known to be short."""
    if max((len(m) for m in maps), default=0) > fragments:
        raise _invalid(
            "bad_request", f"a {what} names at most the job's {fragments} fragments, each once"
        )
    bad = sorted({p for p in named if p >= fragments})
    if bad:
        raise _invalid(
            "bad_request", f"fragments {bad} do not exist; this job has 0..{fragments - 1}"
        )


def check_hello(hello: session_pb2.Hello, job: str) -> None:
    """A hello's fields and size, before any of its spec is read leaf by leaf (the spec is
    checked by `check_spec`, off the event loop, unless it is known by its digest)."""
    check_job(hello.job, job)
    if not hello.learner_id or not hello.incarnation:
        raise _invalid("bad_request", "hello needs a learner_id and an incarnation")
    if max(len(hello.learner_id), len(hello.incarnation)) > MAX_NAME_CHARS:
        raise _invalid("bad_request", f"learner_id and incarnation: at most {MAX_NAME_CHARS} chars")
    if len(hello.params) > MAX_LEAVES:
        raise _invalid(
            "bad_request",
            f"the model spec has {len(hello.params)} leaves; a job takes at most {MAX_LEAVES}: "
            "group small tensors into fewer, larger ones (stack the layers' weights)",
        )
    size = hello.ByteSize()
    if size > MAX_HELLO_BYTES:
        raise _invalid(
            "bad_request",
            f"the hello is {size} bytes; at most {MAX_HELLO_BYTES} (4 MiB) for the model spec's "
            "leaf names and shapes: shorten the leaf names or group small tensors into fewer, "
            "larger ones",
        )
    if not 0 <= hello.step <= MAX_STEP:
        raise _invalid("bad_request", f"hello step {hello.step} is out of 0..2^53")


def check_spec(params: Sequence[fragment_pb2.TensorSpec]) -> None:
    """A model spec leaf by leaf (up to MAX_LEAVES of them: run it off the event loop)."""
    total = 0
    for leaf in params:
        values = 1
        for d in leaf.shape:
            values *= max(0, d)
        if (
            len(leaf.name) > MAX_LEAF_NAME_CHARS
            or len(leaf.shape) > MAX_RANK
            or any(d < 0 for d in leaf.shape)
            or values > MAX_LEAF_VALUES
        ):
            raise _invalid(
                "bad_request",
                f"leaf {leaf.name[:64]!r}: name over {MAX_LEAF_NAME_CHARS} chars, rank over "
                f"{MAX_RANK}, a negative dimension or over 2^40 values",
            )
        total += values
    if total > MAX_SPEC_VALUES:
        raise _invalid(
            "bad_request",
            f"the model spec holds {total} values; a job takes at most 2^40 (4 TiB in "
            "float32): check the leaves' shapes",
        )


def spec_digest(hello: session_pb2.Hello) -> bytes:
    """SHA-256 of a hello's model spec as serialized: a later hello whose spec has the same
    digest has the same spec, known without reading it leaf by leaf."""
    spec = session_pb2.Hello()
    spec.CopyFrom(hello)  # whole, in C: copying the leaves one by one takes longer
    spec.DiscardUnknownFields()
    spec.job = spec.learner_id = spec.incarnation = spec.token = ""
    spec.step = 0
    return hashlib.sha256(spec.SerializeToString(deterministic=True)).digest()


def check_heartbeat(hb: session_pb2.Heartbeat) -> None:
    """A heartbeat's numbers: steps exact in a double, seconds and rates finite and sane,
    losses finite or NaN (NaN: not known yet)."""
    if not 0 <= hb.step <= MAX_STEP:
        raise _invalid("bad_request", f"heartbeat step {hb.step} is out of 0..2^53")
    if not _finite_in(hb.step_time_ema_s, 0.0, MAX_STEP_TIME_S):
        raise _invalid("bad_request", f"step_time_ema_s must be finite, 0..{MAX_STEP_TIME_S:.0f} s")
    if not _finite_in(hb.tokens_per_s, 0.0, math.inf):
        raise _invalid("bad_request", "tokens_per_s must be finite and >= 0")
    for name in ("loss", "eval_loss"):
        value = getattr(hb, name)
        if math.isinf(value):
            raise _invalid("bad_request", f"{name} must be finite, or NaN while unknown")
    if len(hb.still_to_send) > 1 << 16:
        raise _invalid("bad_request", "still_to_send names too many fragments")


def counted_steps(counted: float, claimed: int, elapsed_s: float, max_steps_per_s: float) -> float:
    """How many of a learner slot's steps count toward the job's budget: what it claims, but
    never more than `max_steps_per_s` per second past what counted before, so no claim can
    spend the budget at once. A lower claim (a learner restored from an earlier checkpoint)
    counts at once; a claim that ran ahead catches up at the bound."""
    return min(float(claimed), counted + max(0.0, elapsed_s) * max_steps_per_s)


def check_update_fields(chunk: session_pb2.UpdateChunk) -> None:
    """The first chunk's numbers (its weight, compute time, sizes) before anything is summed."""
    if chunk.kind == session_pb2.UPDATE_KIND_OUTER_GRADIENT and not (
        1 <= chunk.c_steps <= MAX_C_STEPS
    ):
        raise _invalid("bad_request", f"c_steps {chunk.c_steps} is out of 1..{MAX_C_STEPS}")
    if not 0 <= chunk.c_tokens <= MAX_C_TOKENS:
        raise _invalid("bad_request", f"c_tokens {chunk.c_tokens} is out of 0..10^15")
    if not _finite_in(chunk.compute_seconds, 0.0, MAX_COMPUTE_SECONDS):
        raise _invalid(
            "bad_request", f"compute_seconds must be finite, 0..{MAX_COMPUTE_SECONDS:.0f}"
        )
    if any(not _finite_in(n, 0.0, math.inf) for n in chunk.tensor_norms):
        raise _invalid("non_finite", "tensor_norms must be finite and >= 0")
    if max(len(chunk.learner_id), len(chunk.incarnation)) > MAX_NAME_CHARS:
        raise _invalid("bad_request", f"learner_id and incarnation: at most {MAX_NAME_CHARS} chars")


def max_payload_bytes(n: int, block_size: int, chunks: int) -> int:
    """The most bytes any codec encodes `n` values in, cut in `chunks` chunks: fp32's four
    per value, or a codec's per-block scales and offsets (at most 4 + 4 bytes per block
    and chunk) on top of at most a byte per value."""
    blocks = -(-n // block_size) + chunks if block_size else 0
    return 4 * n + 16 * blocks


# --- the bounds an update's values are held to --------------------------------------------
# An update covering more steps than its reference may be this many times its norm at most
# (a claimed step count cannot widen the bound without limit).
MAX_STEP_SPAN = 8.0
# With no other learner's update to measure an update against, a fragment of all zeros (or
# nearly: biases) is measured as if its values had this root mean square.
REFERENCE_RMS = 0.1


def update_weight(c_tokens: int, c_steps: int, cap: float | None, staleness: float) -> float:
    """What an update weighs in its round: its tokens' weight (`token_weight`), at most
    `cap` (None: provisional, as claimed), times its staleness factor; never zero."""
    weight = token_weight(c_tokens, c_steps)
    if cap is not None:
        weight = min(weight, cap)
    return max(weight * staleness, 1e-30)


def step_scale(steps: int, reference_steps: int) -> float:
    """How much larger than a reference update of `reference_steps` inner steps an honest
    update of `steps` steps may be. An outer gradient's norm grows between the square root
    of its steps (noise) and linearly (a steady direction): fewer steps scale by the square
    root, more steps linearly, at most MAX_STEP_SPAN times. Steps differ between honest
    updates: a learner whose reply comes late sends more steps at once, and the one after
    it fewer."""
    x = max(1, steps) / max(1, reference_steps)
    return math.sqrt(x) if x < 1.0 else min(x, MAX_STEP_SPAN)


def others_norm(norms: Recent, learner: str, steps: int) -> float | None:
    """The median of the other learners' norms in `norms` (kept under the inner steps each
    covered), each scaled to an update of `steps` steps (`step_scale`): what the bounds on
    an update of `learner` are multiples of. None if there are no others."""
    return norms.median_of_others(learner, lambda s: step_scale(steps, s))


def claimed_norm(norms: Sequence[float]) -> float:
    """The L2 norm an update's per-tensor norms add up to."""
    return math.sqrt(sum(float(n) ** 2 for n in norms))


class Guards:
    """The bounds on one fragment's updates, from its recent accepted ones: each learner's
    last weight (as capped) and its L2 norm under the inner steps it covered, and the
    fragment's own norm. A learner's own history never moves its bar."""

    def __init__(self, config: JobConfig, size: int) -> None:
        self.config, self.size = config, size
        self.weights = Recent()
        self.norms = Recent()
        self.theta_norm = 0.0  # the fragment's committed value's L2 norm

    def weight_cap(self, learner: str) -> float | None:
        """The most an update of `learner` may weigh: --max-weight-share times the median
        weight of the other learners' last updates (its fair share), so that whatever tokens
        it claims it cannot buy the merge, and its own claims never move the bar. None while
        no other learner's update is known."""
        median = self.weights.median_of_others(learner)
        return None if median is None else self.config.max_weight_share * median

    def norm_bound(self, learner: str, steps: int) -> float:
        """The largest L2 norm an update of `steps` inner steps may have:
        --max-update-norm-ratio times the median of the other learners' last accepted
        updates (a learner's own never moves its bar; a refused one moves no one's, so
        refusals cost an attacker nothing and gain it nothing), each scaled to `steps`
        (`step_scale`: a learner whose reply came late sends more steps at once, and the next
        update fewer); never below the fragment's own norm, as if its values had an RMS of at
        least REFERENCE_RMS (a fragment of zeros): learners whose updates outgrow each other's
        tiny last ones together, as in warm-up, are not shut out, and an attacker gains at
        most the fragment's size times its capped weight. With no other learner's update
        yet, --max-update-norm-ratio times that size (an outer gradient is a fraction of the
        parameters it moves); never the learner's own last norm, which would let a slot
        alone on a fragment raise its own bar tenfold with every update."""
        ratio = self.config.max_update_norm_ratio
        size = max(self.theta_norm, REFERENCE_RMS * math.sqrt(self.size))
        median = others_norm(self.norms, learner, steps)
        if median is not None:
            return max(ratio * median, size)
        return ratio * size

    def drop_bound(self, learner: str, steps: int) -> float | None:
        """The L2 norm over which a whole update is merged at no weight, not clipped:
        --max-update-norm-ratio times the median of the other slots' last accepted updates of
        the fragment, as they merged, each scaled to `steps` (`step_scale`), with no floor.
        An update that many times the others' carries no honest progress worth keeping (an
        honest one that outgrows them a little is clipped, `clip_bound`), and one of the
        fragment's own size (a slot replacing it) would otherwise merge clipped every round,
        its direction kept. None while no other slot has history: the warm-up bound clips."""
        median = others_norm(self.norms, learner, steps)
        return self.config.max_update_norm_ratio * median if median else None

    def clip_bound(self, learner: str, steps: int) -> float:
        """The L2 norm an update of `steps` inner steps is scaled down to if larger:
        --clip-norm-ratio times the median of the other slots' last accepted updates of the
        fragment, as they merged (clipped), each scaled to `steps` (`step_scale`). Kept in
        the control store (its norm history), so a new owner measures against the same
        history. A slot's own history never moves its bar, and only clipped norms enter the
        history, so slots short of a majority of those with history cannot raise it: their
        entries sit above the median. With no other slot's (the fragment's first update, or
        a slot alone on it): --warmup-update-rms per value, never a multiple of the
        fragment's own norm, which let one update replace the fragment."""
        median = others_norm(self.norms, learner, steps)
        if median:  # None, or others that sent nothing: the warm-up bound
            return self.config.clip_norm_ratio * median
        return self.config.warmup_update_rms * math.sqrt(self.size)
