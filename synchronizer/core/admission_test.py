import math

import numpy as np
import pytest

from services import codec as codecs
from services.gen.atoll.v1 import fragment_pb2, session_pb2
from services.layout import LeafSpec, fragment_layout
from services.wire import segments_header
from synchronizer.core.admission import (
    MAX_LEAVES,
    MAX_STEP_SPAN,
    Rejection,
    Status,
    check_header,
    check_heartbeat,
    check_hello,
    check_spec,
    check_update_fields,
    counted_steps,
    initial_values,
    max_payload_bytes,
    parse_chunk,
    spec_digest,
    step_scale,
)

LAYOUT = fragment_layout([LeafSpec("a", (100,)), LeafSpec("b", (50,))], 2)
OUTER = session_pb2.UPDATE_KIND_OUTER_GRADIENT


def header(**kw: int) -> fragment_pb2.PayloadHeader:
    h = segments_header(0, fragment_pb2.CODEC_INT8, 256, 100, [codecs.Segment(0, 100, b"")])
    for k, v in kw.items():
        setattr(h, k, v)
    return h


@pytest.mark.parametrize(
    ("kw", "kind", "c_steps", "reason"),
    [
        ({"fragment": 2}, OUTER, 1, "unknown_fragment"),
        ({"num_elements": 99}, OUTER, 1, "shape_mismatch"),
        ({"codec": 99}, OUTER, 1, "bad_codec"),
        ({}, 7, 1, "bad_request"),
        ({}, OUTER, 0, "bad_request"),
        ({}, session_pb2.UPDATE_KIND_INITIAL, 0, "bad_codec"),
    ],
)
def test_bad_headers_are_refused(kw: dict[str, int], kind: int, c_steps: int, reason: str) -> None:
    with pytest.raises(Rejection) as info:
        check_header(header(**kw), kind, c_steps, LAYOUT)
    assert info.value.reason == reason
    assert info.value.code == Status.INVALID_ARGUMENT
    assert info.value.message


def test_first_values_are_refused_with_what_is_wrong() -> None:
    assert initial_values(np.ones(100, np.float32).tobytes(), 100).sum() == 100
    with pytest.raises(Rejection, match="NaN") as info:
        initial_values(np.full(100, np.inf, np.float32).tobytes(), 100)
    assert info.value.reason == "non_finite"
    with pytest.raises(Rejection) as info:
        initial_values(b"\x00" * 12, 100)
    assert info.value.reason == "bad_codec"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("step", 2**64 - 1),
        ("step_time_ema_s", 1e9),
        ("step_time_ema_s", float("nan")),
        ("tokens_per_s", -1.0),
        ("tokens_per_s", float("inf")),
        ("loss", float("inf")),
    ],
)
def test_heartbeats_out_of_range_are_refused(field: str, value: float) -> None:
    hb = session_pb2.Heartbeat(step=10, step_time_ema_s=0.5, tokens_per_s=100.0)
    setattr(hb, field, value)
    with pytest.raises(Rejection):
        check_heartbeat(hb)


def test_a_heartbeat_with_unknown_losses_passes() -> None:
    check_heartbeat(session_pb2.Heartbeat(step=2**53, loss=float("nan"), eval_loss=float("nan")))


def test_a_slots_steps_count_as_claimed_up_to_the_rate_bound() -> None:
    assert counted_steps(100.0, 130, 1.0, 1000.0) == 130  # an honest pace counts as claimed
    assert counted_steps(100.0, 2**53, 1.0, 50.0) == 150  # a lie counts at the bound
    assert counted_steps(150.0, 2**53, 0.5, 50.0) == 175  # and keeps to it
    assert counted_steps(100.0, 40, 1.0, 50.0) == 40  # restored from an earlier checkpoint
    assert counted_steps(100.0, 2**53, -5.0, 50.0) == 100  # a clock going back adds nothing
    # A slow bound still advances: fractions of a step carry over between heartbeats.
    steps = 0.0
    for _ in range(4):
        steps = counted_steps(steps, 10, 1.0, 0.5)
    assert steps == 2.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("c_steps", 0),
        ("c_steps", 10**9 + 1),
        ("c_tokens", 10**15 + 1),
        ("compute_seconds", float("nan")),
        ("compute_seconds", -1.0),
        ("compute_seconds", 1e7),
    ],
)
def test_update_numbers_out_of_range_are_refused(field: str, value: float) -> None:
    chunk = session_pb2.UpdateChunk(kind=OUTER, c_steps=10, c_tokens=1000, compute_seconds=1.0)
    check_update_fields(chunk)
    setattr(chunk, field, value)
    with pytest.raises(Rejection):
        check_update_fields(chunk)


def test_an_update_announcing_more_bytes_than_its_values_encode_in_is_refused() -> None:
    check_header(header(total_bytes=max_payload_bytes(100, 256, 1)), OUTER, 1, LAYOUT)
    with pytest.raises(Rejection, match="announces"):
        check_header(header(total_bytes=324_000_000), OUTER, 1, LAYOUT)
    with pytest.raises(Rejection, match="chunk_count"):
        check_header(header(chunk_count=101), OUTER, 1, LAYOUT)


def test_a_hello_too_large_is_refused_before_its_spec_is_read() -> None:
    leaves = [fragment_pb2.TensorSpec(name="x", shape=[1])] * (MAX_LEAVES + 1)
    hello = session_pb2.Hello(job="j", learner_id="a", incarnation="i", params=leaves)
    with pytest.raises(Rejection, match=r"100001 leaves; .* at most 100000: group small tensors"):
        check_hello(hello, "j")
    names = [fragment_pb2.TensorSpec(name="x" * 1000, shape=[1])] * 5000
    with pytest.raises(Rejection, match=r"at most 4194304 .*: shorten the leaf names"):
        check_hello(session_pb2.Hello(job="j", learner_id="a", incarnation="i", params=names), "j")


def test_a_spec_is_checked_leaf_by_leaf_and_in_total() -> None:
    check_spec([fragment_pb2.TensorSpec(name="w", shape=[2**20, 2**20])])
    with pytest.raises(Rejection, match="2\\^40 values"):
        check_spec([fragment_pb2.TensorSpec(name="w", shape=[2**41])])
    with pytest.raises(Rejection, match="rank over"):
        check_spec([fragment_pb2.TensorSpec(name="w", shape=[1] * 17)])
    with pytest.raises(Rejection, match="holds 2199023255552 values; a job takes at most 2\\^40"):
        check_spec([fragment_pb2.TensorSpec(name=f"w{i}", shape=[2**40]) for i in range(2)])


def test_a_specs_digest_is_of_its_leaves_only() -> None:
    leaves = [fragment_pb2.TensorSpec(name="a", shape=[2, 3]), fragment_pb2.TensorSpec(name="b")]
    one = session_pb2.Hello(job="j", learner_id="a", incarnation="i", params=leaves, step=5)
    other = session_pb2.Hello(job="k", learner_id="b", incarnation="x", token="t", params=leaves)
    assert spec_digest(one) == spec_digest(other)
    other.params[0].shape[1] = 4
    assert spec_digest(one) != spec_digest(other)


@pytest.mark.parametrize(
    "message",
    [
        session_pb2.UpdateChunk(seq=3, data=b"payload", learner_id="a").SerializeToString(),
        # The payload twice (the later wins), or among a million more fields: parsed whole.
        session_pb2.UpdateChunk(data=b"first").SerializeToString()
        + session_pb2.UpdateChunk(seq=3, data=b"payload", learner_id="a").SerializeToString(),
        session_pb2.UpdateChunk(learner_id="a", data=b"payload").SerializeToString()
        + b"\x18\x00" * (1 << 20)
        + session_pb2.UpdateChunk(seq=3).SerializeToString(),
    ],
)
def test_an_ingest_message_arrives_as_its_fields_and_its_payload(message: bytes) -> None:
    whole = session_pb2.UpdateChunk.FromString(message)
    arrived = parse_chunk(message)
    assert bytes(arrived.data) == whole.data == b"payload"
    assert not arrived.chunk.data
    assert (arrived.chunk.seq, arrived.chunk.learner_id) == (3, "a")


def test_an_update_of_more_steps_may_be_larger_and_one_of_fewer_is_held_to_the_noise_floor() -> (
    None
):
    assert step_scale(10, 10) == 1.0
    # A reply came late: 30 steps at once after 5 (what an honest learner under load sent,
    # and the bound refused before steps counted).
    assert step_scale(30, 5) == 6.0
    # The update after it: 1 step after 2H - 1; its norm shrinks at most as noise does.
    assert math.isclose(step_scale(1, 199), math.sqrt(1 / 199))
    # A claimed step count widens the bound only so far.
    assert step_scale(10**9, 10) == MAX_STEP_SPAN
    assert step_scale(0, 0) == 1.0
