from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path

import numpy as np
import pytest

from services import codec as codecs
from services.config import JobConfig
from services.tape import Tape
from synchronizer.core.merge import RadialAccumulator
from synchronizer.core.recent import Recent
from synchronizer.owner import (
    MAX_STEP_SPAN,
    Chunk,
    FragmentOwner,
    NormTooLarge,
    Update,
    step_scale,
)
from synchronizer.store.redis_store import Live, LiveLearner
from synchronizer.store.tensors import TensorStore


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


def _owner(tmp_path: Path, size: int) -> FragmentOwner:
    """An owner of one fragment of `size` values, for its sums alone (no store touched)."""
    return FragmentOwner(
        fragment=0,
        size=size,
        segments=(size,),
        epoch=1,
        replica="r",
        config=JobConfig(max_weight_share=2.0),
        store=None,  # type: ignore[arg-type]  # a round's sums touch no store
        tensors=TensorStore(str(tmp_path)),
        tape=Tape(None, "r"),
        fragments=1,
    )


def _provisional(
    owner: FragmentOwner, name: str, weight: float, x: np.ndarray, step: int
) -> Update:
    codec = codecs.by_name("int8")
    update = Update(
        name, "i", 1, 0, 10, 100, 1.0, weight, (1.0,), codec, 64, owner.current, provisional=True
    )
    for segment in codecs.encode_segments(codec, x, 64, step)[0]:
        update.chunks.append(Chunk(segment, None))
    return update


@pytest.mark.parametrize("second_step", [400, 300])
def test_a_sealed_rounds_provisional_updates_sum_as_one_by_one(
    tmp_path: Path, second_step: int
) -> None:
    """Chunks of the same ranges are summed range by range side by side; chunks whose
    ranges overlap (another chunking) one after another: either way the sum of each
    capped weight times each decoded update."""
    size = 1000
    owner = _owner(tmp_path, size)
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=size).astype(np.float32) for _ in range(3)]
    members = [
        _provisional(owner, "a", 1.0, xs[0], 400),
        _provisional(owner, "b", 1.5, xs[1], second_step),
        _provisional(owner, "c", 100.0, xs[2], 400),  # capped: 2 x the median of 1 and 1.5
    ]
    sealed = owner.current
    owner._sum_provisional(members, sealed)
    codec = codecs.by_name("int8")
    decoded = [codec.decode(codec.encode(x, 64), size, 64) for x in xs]
    assert [u.weight for u in members] == [1.0, 1.5, 2.5]
    expected = sum(np.float32(w) * d for w, d in zip([1.0, 1.5, 2.5], decoded, strict=True))
    np.testing.assert_allclose(sealed.total, expected, rtol=1e-6, atol=1e-6)
    assert sealed.weight == 5.0
    assert all(not u.chunks for u in members)
    owner.close()


@pytest.mark.parametrize("with_counted_member", [False, True])
def test_provisional_updates_summed_as_they_arrive_join_the_round_whole_when_not_capped(
    tmp_path: Path, with_counted_member: bool
) -> None:
    """Provisional chunks are summed apart as they arrive, at the weights claimed; a sealed
    round whose weights all stand takes that sum whole (the round's own when it has no
    other member), and a chunk moved to the next round leaves the sealed one's sums."""
    size = 1000
    owner = _owner(tmp_path, size)
    codec = codecs.by_name("int8")
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=size).astype(np.float32) for _ in range(3)]
    decoded = [codec.decode(codec.encode(x, 64), size, 64) for x in xs]
    sealed = owner.current

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
            owner._add(update, s.offset, s.count, s.data)
        return update

    members = [arriving("a", 1.0, xs[0], True), arriving("b", 1.5, xs[1], True)]
    weights = [1.0, 1.5]
    if with_counted_member:
        counted = arriving("c", 2.0, xs[2], False)
        sealed.counted(counted.weight, counted.norms, 1)
        weights.append(2.0)
    # An update still arriving when the round is sealed: moved out, provisional sum too.
    late = arriving("d", 1.0, xs[2], True)
    owner.current = owner.rule.new(size, owner.segments)
    late.accumulator = owner.current
    owner._move(late, sealed)
    assert sealed.provisional is not None
    held = sealed.provisional.total
    owner._sum_provisional(members, sealed)
    if not with_counted_member:  # what was moved out weighed within the cap: sum kept whole
        assert sealed.total is held
    assert sealed.provisional is None
    expected = sum(np.float32(w) * d for w, d in zip(weights, decoded, strict=False))
    np.testing.assert_allclose(sealed.total, expected, rtol=1e-5, atol=1e-5)
    assert sealed.weight == sum(weights)
    assert all(not u.chunks for u in members)
    assert owner.current.provisional is not None
    np.testing.assert_allclose(owner.current.provisional.total, decoded[2], rtol=1e-6, atol=1e-6)
    owner.close()


def test_a_provisional_update_still_arriving_at_sealing_is_capped_into_the_next_rounds_sum(
    tmp_path: Path,
) -> None:
    """Other learners' weights are known once its round is sealed: an update that began
    without them is capped as any update is and moves into the next round's own sum,
    which then needs no provisional sum (a fragment-sized array) of its own."""
    size = 1000
    owner = _owner(tmp_path, size)  # --max-weight-share 2
    codec = codecs.by_name("int8")
    x = np.random.default_rng(4).normal(size=size).astype(np.float32)
    sealed = owner.current
    # claims c_tokens^2 / c_steps = 1000; began when no other weight was known
    late = Update("late", "i", 1, 0, 10, 100, 1.0, 1000.0, (1.0,), codec, 64, sealed)
    late.provisional = True
    owner.open.stream(late)
    for s in codecs.encode_segments(codec, x, 64, 400)[0]:
        owner._add(late, s.offset, s.count, s.data)
    assert sealed.provisional is not None
    owner.weights = Recent({"a": 1.0, "b": 3.0, "late": 1000.0})  # received meanwhile (not its own)
    _, got = owner._seal()
    assert got is sealed
    assert late.moved is not None
    late.moved.result(timeout=30)
    assert not late.provisional
    assert late.weight == 4.0  # 2 x the median of 1 and 3
    assert late.accumulator is owner.current
    assert owner.current.provisional is None
    decoded = codec.decode(codec.encode(x, 64), size, 64)
    np.testing.assert_allclose(owner.current.total, 4.0 * decoded, rtol=1e-6, atol=1e-6)
    assert sealed.provisional.taken_out == 1000.0  # the sum it left says what left it
    np.testing.assert_allclose(sealed.provisional.total, 0.0, atol=1e-3)
    owner.close()


def test_a_chunk_summed_as_its_round_was_sealed_moves_with_the_rest_at_the_settled_weight(
    tmp_path: Path,
) -> None:
    """A chunk whose sum began just after its round was sealed read the new round, and was
    summed into that round's provisional sum at the weight claimed; the move that settles
    the weight brings it, too, into the round's own sum at the weight settled."""
    size = 1000
    owner = _owner(tmp_path, size)
    codec = codecs.by_name("int8")
    x = np.random.default_rng(6).normal(size=size).astype(np.float32)
    segments = codecs.encode_segments(codec, x, 64, 400)[0]
    sealed = owner.current
    late = Update("late", "i", 1, 0, 10, 100, 1.0, 1000.0, (1.0,), codec, 64, sealed)
    late.provisional = True
    for s in segments[:-1]:
        owner._add(late, s.offset, s.count, s.data)
    owner.current = owner.rule.new(size, owner.segments)  # sealed: the update moves on
    late.accumulator = owner.current
    last = segments[-1]
    owner._add(late, last.offset, last.count, last.data)  # began once the seal had run
    assert late.chunks[-1].accumulator is owner.current.provisional
    owner._move(late, sealed, cap=4.0)
    assert late.weight == 4.0
    assert all(chunk.accumulator is owner.current for chunk in late.chunks)
    decoded = codec.decode(codec.encode(x, 64), size, 64)
    np.testing.assert_allclose(owner.current.total, 4.0 * decoded, rtol=1e-6, atol=1e-6)
    assert owner.current.provisional is not None
    np.testing.assert_allclose(owner.current.provisional.total, 0.0, atol=1e-3)
    owner.close()


def test_a_provisional_sum_something_was_taken_out_of_is_summed_again_from_the_chunks(
    tmp_path: Path,
) -> None:
    """An update claiming a huge weight, summed apart and then refused, cancels the other
    provisional updates' float32 bits in that sum: the round sums its members again."""
    size = 1000
    owner = _owner(tmp_path, size)
    codec = codecs.by_name("int8")
    x = np.random.default_rng(2).normal(size=size).astype(np.float32)
    sealed = owner.current

    def arriving(name: str, weight: float, values: np.ndarray) -> Update:
        update = Update(
            name, "i", 1, 0, 10, 100, 1.0, weight, (1.0,), codec, 64, sealed, provisional=True
        )
        for s in codecs.encode_segments(codec, values, 64, 400)[0]:
            owner._add(update, s.offset, s.count, s.data)
        return update

    honest = arriving("a", 1.0, x)
    owner._take_out(arriving("h", 1e9, x))  # refused after summing
    assert sealed.provisional is not None
    assert sealed.provisional.taken_out == 1e9
    owner._sum_provisional([honest], sealed)
    decoded = codec.decode(codec.encode(x, 64), size, 64)
    np.testing.assert_allclose(sealed.total, decoded, rtol=1e-6, atol=1e-6)
    assert sealed.weight == 1.0
    owner.close()


def test_the_round_expects_an_update_streaming_in_at_the_pace_of_its_chunks_after_the_first(
    tmp_path: Path,
) -> None:
    """What the round rule is told of updates still arriving: one ETA each from the chunks
    that came after its first (the first's arrival says nothing of the pace), none before
    a second chunk, none for one moved to another round; their learners count as waiting."""
    size = 1024
    owner = _owner(tmp_path, size)
    codec = codecs.by_name("int8")
    x = np.random.default_rng(3).normal(size=size).astype(np.float32)
    segments = codecs.encode_segments(codec, x, 64, 4 * (64 + 4))[0]  # 4 blocks a chunk
    assert [s.count for s in segments] == [256] * 4

    def arriving(name: str, chunks: int) -> Update:
        update = Update(name, "i", 1, 0, 10, 100, 1.0, 1.0, (1.0,), codec, 64, owner.current)
        owner.open.stream(update)

        async def send() -> None:
            for s in segments[:chunks]:
                await owner.add(update, s.offset, s.count, s.data)

        asyncio.run(send())
        return update

    paced = arriving("a", 3)  # 768 of 1024 values in: 512 after the first chunk's 256
    assert (paced.arrived, paced.first_values) == (768, 256)
    started = arriving("b", 1)  # one chunk: no pace yet
    moved = arriving("c", 3)
    moved.accumulator = owner.rule.new(size, owner.segments)  # its round was sealed

    live = Live(now_s=0.0, learners=(LiveLearner("a", 0.5, False, None),))
    state, slowest = owner.round_state(live, now=paced.first_at + 2.0)
    # 512 values in 2 s after the first chunk: the 256 still to come in 1 s more.
    assert state.streaming_eta_s == pytest.approx((1.0,), rel=1e-6)
    assert started.first_at > 0
    assert started.arrived == started.first_values
    # "b" and "c" are not live learners but have updates arriving: they count as waiting;
    # "a", live and not yet in, too.
    assert state.waiting == 3
    assert slowest == 0.5
    owner.close()


def test_an_abandoned_update_is_out_of_the_sum_before_a_round_sealed_after_it_steps(
    tmp_path: Path,
) -> None:
    """An update refused (or broken off) while the worker is busy: its chunk sums still
    queued add nothing, and what it summed leaves before a round sealed meanwhile reads its
    sum, even with the step queued ahead of the chunk sums."""
    size = 1024
    owner = _owner(tmp_path, size)
    codec = codecs.by_name("int8")
    segments = codecs.encode_segments(codec, np.ones(size, np.float32), 64, 4 * (64 + 4))[0]
    update = Update("a", "i", 1, 0, 10, 100, 1.0, 1.0, (1.0,), codec, 64, owner.current)
    owner.open.stream(update)

    async def run() -> tuple[float, int]:
        await owner.add(update, segments[0].offset, segments[0].count, segments[0].data)
        gate = threading.Event()
        owner.worker.submit(gate.wait)  # the worker busy with other updates' sums
        queued = [owner.add(update, s.offset, s.count, s.data) for s in segments[1:]]
        abandoning = asyncio.ensure_future(owner.abandon(update))
        await asyncio.sleep(0)
        _, sealed = owner._seal()  # a round sealed right after: its step jumps the queue
        step_read = owner.worker.urgent(lambda: float(sealed.total.sum()))
        gate.set()
        seen = await asyncio.wrap_future(step_read)
        sealed.release()  # as a merge does once its step has read the sum
        await abandoning
        await asyncio.gather(*queued)
        return seen, len(update.chunks)

    seen, chunks = asyncio.run(run())
    assert seen == 0.0  # none of the abandoned update's values reached the step
    assert chunks == 0  # its queued chunk sums added nothing after
    np.testing.assert_array_equal(owner.current.total, np.zeros(size, np.float32))
    owner.close()


def test_an_update_received_while_its_move_is_queued_joins_the_next_round_as_moved(
    tmp_path: Path,
) -> None:
    """Its round sealed while Redis recorded it: the move that settles its provisional
    weight is still queued behind other work on the worker. Receiving it waits for that
    move, so it is counted in the next round at the weight its values were moved at."""
    size = 1000
    owner = _owner(tmp_path, size)
    codec = codecs.by_name("int8")
    x = np.random.default_rng(5).normal(size=size).astype(np.float32)
    late = Update("late", "i", 1, 0, 10, 100, 1.0, 1000.0, (1.0,), codec, 64, owner.current)
    late.provisional = True
    owner.open.stream(late)
    for s in codecs.encode_segments(codec, x, 64, 400)[0]:
        owner._add(late, s.offset, s.count, s.data)
    owner.weights = Recent({"a": 1.0, "b": 3.0})

    async def recorded(update: Update, checksum: int, record: object) -> tuple[str, int]:
        return "received", 1  # what Redis answers (the store is not this test's)

    owner._record = recorded  # type: ignore[method-assign]

    async def run() -> tuple[str, int]:
        started, gate = threading.Event(), threading.Event()

        def busy() -> None:  # the worker busy: the move waits behind this job
            started.set()
            gate.wait()

        owner.worker.submit(busy)
        await asyncio.to_thread(started.wait, 30)
        owner._seal()
        receiving = asyncio.ensure_future(owner.receive(late, 0))
        await asyncio.sleep(0.05)
        assert not receiving.done()  # waiting for its move
        gate.set()
        return await receiving

    assert asyncio.run(run()) == ("received", 1)
    assert late in owner.open.members
    assert not late.provisional
    assert owner.current.weight == 4.0  # counted, at the weight it was moved at
    assert owner.weights["late"] == 4.0
    owner.close()


@pytest.mark.parametrize("name", ["fp32", "int8", "int4", "bf16"])
def test_a_chunk_over_the_norm_bound_is_refused_before_it_touches_the_sum(
    tmp_path: Path, name: str
) -> None:
    """Values far over an update's norm bound, added and taken out again, would cancel the
    other updates' bits in the round's sum (1e30 + x - 1e30 is 0 in float32): they are
    refused before anything of them is added, and the sum stays bit for bit."""
    size = 1000
    owner = _owner(tmp_path, size)
    codec = codecs.by_name(name)
    honest = np.random.default_rng(6).normal(scale=0.01, size=size).astype(np.float32)
    member = Update("a", "i", 1, 0, 10, 100, 1.0, 1.0, (1.0,), codec, 64, owner.current)
    member.norm_bound = 10.0
    for s in codecs.encode_segments(codec, honest, 64, 400)[0]:
        owner._add(member, s.offset, s.count, s.data)
    before = owner.current.total.copy()
    assert np.any(before != 0)
    for scale in (1e30, 1e3):
        hostile = Update("b", "i", 1, 0, 10, 100, 1.0, 1.0, (1.0,), codec, 64, owner.current)
        hostile.norm_bound = 10.0
        first = codecs.encode_segments(codec, np.full(size, scale, np.float32), 64, 400)[0][0]
        with pytest.raises(NormTooLarge, match="L2 norm is over 10") as refused:
            owner._add(hostile, first.offset, first.count, first.data)
        assert refused.value.norm is not None
        assert refused.value.norm > 10.0
        assert not hostile.chunks
        assert hostile.squares == 0.0
        assert owner.current.total.tobytes() == before.tobytes()
        assert owner.current.taken_out == 0.0  # nothing of it was in to take out
    owner.close()


@pytest.mark.parametrize("chunking", ["same", "overlapping", "parts"])
def test_chunks_summed_together_leave_what_summing_one_after_another_leaves(
    tmp_path: Path, chunking: str
) -> None:
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

    def jobs(owner: FragmentOwner) -> tuple[list[Update], list[tuple[Update, int, int, bytes]]]:
        updates = [
            Update(f"l{k}", "i", 1, 0, 10, 100, 1.0, 0.5 + k, (1.0,), codec, 64, owner.current)
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

    one, many = _owner(tmp_path / "one", size), _owner(tmp_path / "many", size)
    one_updates, one_jobs = jobs(one)
    want: list[type | None] = []
    for job in one_jobs:
        try:
            one._add(*job)
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


def test_an_update_over_the_clip_bound_merges_scaled_down_and_its_clipped_norm_is_kept(
    tmp_path: Path,
) -> None:
    """Measured against the other slot's last accepted norm (1.0, 10 steps), an update of
    norm 10 over as many steps is scaled to 3 (--clip-norm-ratio), not refused: its sum holds
    0.3 of its values, and the norm it leaves for the next updates is the clipped one."""
    size = 1000
    owner = _owner(tmp_path, size)
    codec = codecs.by_name("fp32")
    x = np.random.default_rng(6).normal(size=size).astype(np.float32)
    x *= np.float32(10.0 / np.linalg.norm(x.astype(np.float64)))
    owner.norms.set("honest", 1.0, 10)
    assert owner.clip_bound("evil", 10) == 3.0
    assert owner.clip_bound("honest", 10) == 0.05 * math.sqrt(size)  # alone: the warm-up bound
    big = Update("evil", "i", 1, 0, 10, 100, 1.0, 2.0, (10.0,), codec, 0, owner.current)
    owner.open.stream(big)
    for s in codecs.encode_segments(codec, x, 0, 400)[0]:
        owner._add(big, s.offset, s.count, s.data)

    async def recorded(update: Update, checksum: int, record: object) -> tuple[str, int]:
        return "received", 1

    owner._record = recorded  # type: ignore[method-assign]
    assert asyncio.run(owner.receive(big, 0)) == ("received", 1)
    assert math.isclose(big.clip, 0.3, rel_tol=1e-6)
    np.testing.assert_allclose(owner.current.total, 2.0 * 0.3 * x, rtol=1e-5, atol=1e-6)
    assert owner.current.weight == 2.0  # its weight is its own: only its values shrank
    assert math.isclose(owner.norms["evil"], 3.0, rel_tol=1e-5)
    owner.close()


def test_under_radial_merging_a_clipped_update_keeps_its_direction_and_counts_clipped_norms(
    tmp_path: Path,
) -> None:
    """Radial merging sums unit vectors: a clip scales the norms an update is counted with
    (the round's length), not its values (its direction)."""
    size = 1000
    owner = FragmentOwner(
        fragment=0,
        size=size,
        segments=(size,),
        epoch=1,
        replica="r",
        config=JobConfig(merge="radial"),
        store=None,  # type: ignore[arg-type]  # a round's sums touch no store
        tensors=TensorStore(str(tmp_path)),
        tape=Tape(None, "r"),
        fragments=1,
    )
    codec = codecs.by_name("fp32")
    x = np.random.default_rng(8).normal(size=size).astype(np.float32)
    norm = float(np.linalg.norm(x.astype(np.float64)))
    owner.norms.set("honest", norm / 30, 10)  # the bound: 3x that, a tenth of x's norm
    big = Update("evil", "i", 1, 0, 10, 100, 1.0, 1.0, (norm,), codec, 0, owner.current)
    owner.open.stream(big)
    for s in codecs.encode_segments(codec, x, 0, 400)[0]:
        owner._add(big, s.offset, s.count, s.data)

    async def recorded(update: Update, checksum: int, record: object) -> tuple[str, int]:
        return "received", 1

    owner._record = recorded  # type: ignore[method-assign]
    assert asyncio.run(owner.receive(big, 0)) == ("received", 1)
    assert math.isclose(big.clip, 0.1, rel_tol=1e-5)
    np.testing.assert_allclose(owner.current.total, x / norm, rtol=1e-5, atol=1e-7)  # unit
    radial = owner.current
    assert isinstance(radial, RadialAccumulator)
    assert math.isclose(float(radial.norm_sum[0]), 0.1 * norm, rel_tol=1e-5)
    owner.close()
