from __future__ import annotations

import math

import numpy as np
import pytest

from services import codec as codecs
from services.config import JobConfig
from synchronizer.core.merge import REGISTRY
from synchronizer.records import Chunk, NormTooLarge, Update
from synchronizer.summing import RoundSums


def _sums(size: int) -> RoundSums:
    """The sums of one fragment of `size` values, merged by the mean rule."""
    return RoundSums(0, size, (size,), REGISTRY["mean"], JobConfig(max_weight_share=2.0))


def _provisional(sums: RoundSums, name: str, weight: float, x: np.ndarray, step: int) -> Update:
    codec = codecs.by_name("int8")
    update = Update(
        name, "i", 1, 0, 10, 100, 1.0, weight, (1.0,), codec, 64, sums.current, provisional=True
    )
    for segment in codecs.encode_segments(codec, x, 64, step)[0]:
        update.chunks.append(Chunk(segment, None))
    return update


@pytest.mark.parametrize("second_step", [400, 300])
def test_a_sealed_rounds_provisional_updates_sum_as_one_by_one(second_step: int) -> None:
    """Chunks of the same ranges are summed range by range side by side; chunks whose
    ranges overlap (another chunking) one after another: either way the sum of each
    capped weight times each decoded update."""
    size = 1000
    sums = _sums(size)
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=size).astype(np.float32) for _ in range(3)]
    members = [
        _provisional(sums, "a", 1.0, xs[0], 400),
        _provisional(sums, "b", 1.5, xs[1], second_step),
        _provisional(sums, "c", 100.0, xs[2], 400),  # capped: 2 x the median of 1 and 1.5
    ]
    sealed = sums.current
    sums.sum_provisional(members, sealed)
    codec = codecs.by_name("int8")
    decoded = [codec.decode(codec.encode(x, 64), size, 64) for x in xs]
    assert [u.weight for u in members] == [1.0, 1.5, 2.5]
    expected = sum(np.float32(w) * d for w, d in zip([1.0, 1.5, 2.5], decoded, strict=True))
    np.testing.assert_allclose(sealed.total, expected, rtol=1e-6, atol=1e-6)
    assert sealed.weight == 5.0
    assert all(not u.chunks for u in members)
    sums.close()


@pytest.mark.parametrize("with_counted_member", [False, True])
def test_provisional_updates_summed_as_they_arrive_join_the_round_whole_when_not_capped(
    with_counted_member: bool,
) -> None:
    """Provisional chunks are summed apart as they arrive, at the weights claimed; a sealed
    round whose weights all stand takes that sum whole (the round's own when it has no
    other member), and a chunk moved to the next round leaves the sealed one's sums."""
    size = 1000
    sums = _sums(size)
    codec = codecs.by_name("int8")
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=size).astype(np.float32) for _ in range(3)]
    decoded = [codec.decode(codec.encode(x, 64), size, 64) for x in xs]
    sealed = sums.current

    def arriving(name: str, weight: float, x: np.ndarray, provisional: bool) -> Update:
        update = Update(
            name,
            "i",
            1,
            0,
            10,
            100,
            1.0,
            weight,
            (1.0,),
            codec,
            64,
            sealed,
            provisional=provisional,
        )
        for s in codecs.encode_segments(codec, x, 64, 400)[0]:
            sums.add_now(update, s.offset, s.count, s.data)
        return update

    members = [arriving("a", 1.0, xs[0], True), arriving("b", 1.5, xs[1], True)]
    weights = [1.0, 1.5]
    if with_counted_member:
        counted = arriving("c", 2.0, xs[2], False)
        sealed.counted(counted.weight, counted.norms, 1)
        weights.append(2.0)
    # An update still arriving when the round is sealed: moved out, provisional sum too.
    late = arriving("d", 1.0, xs[2], True)
    sums.current = sums.rule.new(size, sums.segments)
    late.accumulator = sums.current
    sums.move(late, sealed)
    assert sealed.provisional is not None
    held = sealed.provisional.total
    sums.sum_provisional(members, sealed)
    if not with_counted_member:  # what was moved out weighed within the cap: sum kept whole
        assert sealed.total is held
    assert sealed.provisional is None
    expected = sum(np.float32(w) * d for w, d in zip(weights, decoded, strict=False))
    np.testing.assert_allclose(sealed.total, expected, rtol=1e-5, atol=1e-5)
    assert sealed.weight == sum(weights)
    assert all(not u.chunks for u in members)
    assert sums.current.provisional is not None
    np.testing.assert_allclose(sums.current.provisional.total, decoded[2], rtol=1e-6, atol=1e-6)
    sums.close()


def test_a_chunk_summed_as_its_round_was_sealed_moves_with_the_rest_at_the_settled_weight() -> None:
    """A chunk whose sum began just after its round was sealed read the new round, and was
    summed into that round's provisional sum at the weight claimed; the move that settles
    the weight brings it, too, into the round's own sum at the weight settled."""
    size = 1000
    sums = _sums(size)
    codec = codecs.by_name("int8")
    x = np.random.default_rng(6).normal(size=size).astype(np.float32)
    segments = codecs.encode_segments(codec, x, 64, 400)[0]
    sealed = sums.current
    late = Update("late", "i", 1, 0, 10, 100, 1.0, 1000.0, (1.0,), codec, 64, sealed)
    late.provisional = True
    for s in segments[:-1]:
        sums.add_now(late, s.offset, s.count, s.data)
    sums.current = sums.rule.new(size, sums.segments)  # sealed: the update moves on
    late.accumulator = sums.current
    last = segments[-1]
    sums.add_now(late, last.offset, last.count, last.data)  # began once the seal had run
    assert late.chunks[-1].accumulator is sums.current.provisional
    sums.move(late, sealed, cap=4.0)
    assert late.weight == 4.0
    assert all(chunk.accumulator is sums.current for chunk in late.chunks)
    decoded = codec.decode(codec.encode(x, 64), size, 64)
    np.testing.assert_allclose(sums.current.total, 4.0 * decoded, rtol=1e-6, atol=1e-6)
    assert sums.current.provisional is not None
    np.testing.assert_allclose(sums.current.provisional.total, 0.0, atol=1e-3)
    sums.close()


def test_a_provisional_sum_something_was_taken_out_of_is_summed_again_from_the_chunks() -> None:
    """An update claiming a huge weight, summed apart and then refused, cancels the other
    provisional updates' float32 bits in that sum: the round sums its members again."""
    size = 1000
    sums = _sums(size)
    codec = codecs.by_name("int8")
    x = np.random.default_rng(2).normal(size=size).astype(np.float32)
    sealed = sums.current

    def arriving(name: str, weight: float, values: np.ndarray) -> Update:
        update = Update(
            name, "i", 1, 0, 10, 100, 1.0, weight, (1.0,), codec, 64, sealed, provisional=True
        )
        for s in codecs.encode_segments(codec, values, 64, 400)[0]:
            sums.add_now(update, s.offset, s.count, s.data)
        return update

    honest = arriving("a", 1.0, x)
    sums.take_out(arriving("h", 1e9, x))  # refused after summing
    assert sealed.provisional is not None
    assert sealed.provisional.taken_out == 1e9
    sums.sum_provisional([honest], sealed)
    decoded = codec.decode(codec.encode(x, 64), size, 64)
    np.testing.assert_allclose(sealed.total, decoded, rtol=1e-6, atol=1e-6)
    assert sealed.weight == 1.0
    sums.close()


@pytest.mark.parametrize("name", ["fp32", "int8", "int4", "bf16"])
def test_a_chunk_over_the_norm_bound_is_refused_before_it_touches_the_sum(name: str) -> None:
    """Values far over an update's norm bound, added and taken out again, would cancel the
    other updates' bits in the round's sum (1e30 + x - 1e30 is 0 in float32): they are
    refused before anything of them is added, and the sum stays bit for bit."""
    size = 1000
    sums = _sums(size)
    codec = codecs.by_name(name)
    honest = np.random.default_rng(6).normal(scale=0.01, size=size).astype(np.float32)
    member = Update("a", "i", 1, 0, 10, 100, 1.0, 1.0, (1.0,), codec, 64, sums.current)
    member.norm_bound = 10.0
    for s in codecs.encode_segments(codec, honest, 64, 400)[0]:
        sums.add_now(member, s.offset, s.count, s.data)
    before = sums.current.total.copy()
    assert np.any(before != 0)
    for scale in (1e30, 1e3):
        hostile = Update("b", "i", 1, 0, 10, 100, 1.0, 1.0, (1.0,), codec, 64, sums.current)
        hostile.norm_bound = 10.0
        first = codecs.encode_segments(codec, np.full(size, scale, np.float32), 64, 400)[0][0]
        with pytest.raises(NormTooLarge, match="L2 norm is over 10") as refused:
            sums.add_now(hostile, first.offset, first.count, first.data)
        assert refused.value.norm is not None
        assert refused.value.norm > 10.0
        assert not hostile.chunks
        assert hostile.squares == 0.0
        assert sums.current.total.tobytes() == before.tobytes()
        assert sums.current.taken_out == 0.0  # nothing of it was in to take out
    sums.close()


@pytest.mark.parametrize("chunking", ["same", "overlapping", "parts"])
def test_chunks_summed_together_leave_what_summing_one_after_another_leaves(chunking: str) -> None:
    """A run of queued chunks summed in one go (`_add_many`): several updates' chunks of
    one range at once, one taken alone for its near budget, a corrupt one and one over its
    norm bound refused, an abandoned one skipped. The sum, each update's squares, hash and
    chunks, and each outcome are those of `_add` chunk after chunk, also where another
    chunking overlaps the ranges, or an update's chunks come out of order as the parts of
    an update in parts may (then summed one after another)."""
    size, rng = 1000, np.random.default_rng(3)
    codec = codecs.by_name("int4")
    xs = [rng.normal(size=size).astype(np.float32) for _ in range(5)]
    steps = [400, 400, 300, 400, 400] if chunking == "overlapping" else [400] * 5

    def jobs(sums: RoundSums) -> tuple[list[Update], list[tuple[Update, int, int, bytes]]]:
        updates = [
            Update(f"l{k}", "i", 1, 0, 10, 100, 1.0, 0.5 + k, (1.0,), codec, 64, sums.current)
            for k in range(5)
        ]
        exact = codec.decode_into(
            np.zeros(size, np.float32),
            1.0,
            codecs.Segment(0, size, bytes(codec.encode(xs[1], 64))),
            64,
        )
        updates[1].norm_bound = math.sqrt(1.2 * exact)  # near: its squares summed first
        updates[3].norm_bound = 1e-3  # over
        updates[4].abandoned = True
        if chunking == "parts":  # the bound just under update 2's norm: its last chunk is over
            whole = bytes(codec.encode(xs[2], 64))
            squares = codec.decode_into(
                np.zeros(size, np.float32), 1.0, codecs.Segment(0, size, whole), 64
            )
            updates[2].norm_bound = math.sqrt(0.999 * squares)
        out: list[tuple[Update, int, int, bytes]] = []
        per = [
            codecs.encode_segments(codec, x, 64, step)[0] for x, step in zip(xs, steps, strict=True)
        ]
        for i in range(max(len(p) for p in per)):  # chunk i of each, in turn
            for k, p in enumerate(per):
                if i < len(p):
                    s = p[i]
                    data = bytes(s.data)
                    if k == 0 and i == 1:
                        data = data[:-1]  # corrupt
                    out.append((updates[k], s.offset, s.count, data))
        if chunking == "parts":  # update 2's last chunk first
            last = max(i for i, job in enumerate(out) if job[0] is updates[2])
            out.insert(0, out.pop(last))
        return updates, out

    one, many = _sums(size), _sums(size)
    one_updates, one_jobs = jobs(one)
    want: list[type | None] = []
    for job in one_jobs:
        try:
            one.add_now(*job)
            want.append(None)
        except Exception as err:
            want.append(type(err))
    many_updates, many_jobs = jobs(many)
    got = [type(o) if o is not None else None for o in many._add_many(many_jobs)]
    assert got == want
    assert codecs.CodecError in want
    assert NormTooLarge in want
    assert many.current.total.tobytes() == one.current.total.tobytes()
    assert many.current.total.any()
    for a, b in zip(one_updates, many_updates, strict=True):
        assert a.squares == b.squares
        assert a.hasher.intdigest() == b.hasher.intdigest()
        assert [(c.segment.offset, c.segment.count) for c in a.chunks] == [
            (c.segment.offset, c.segment.count) for c in b.chunks
        ]
    one.close()
    many.close()
