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
from synchronizer.core.merge.rules.radial import Radial
from synchronizer.core.recent import Recent
from synchronizer.core.rounds import Live, LiveLearner
from synchronizer.owner import FragmentOwner
from synchronizer.records import Update
from synchronizer.store.memory_store import MemoryControlStore
from synchronizer.store.tensors import TensorStore


def _store(*learners: str, initialized: bool = True) -> MemoryControlStore:
    """A job whose fragment 0 is owned by replica "r" at epoch 1 (and has a value, unless
    not `initialized`), and whose `learners` each said hello as incarnation "i"."""
    store = MemoryControlStore("job")

    async def setup() -> None:
        assert await store.own("acquire", 0, "r", ttl_s=3600) == ("owned", 1)
        if initialized:
            assert await store.init_fragment(0, "job/fragment-00000/v0.value", ())
        for learner in learners:
            assert (await store.hello("[]", learner, "i", 3600, 0, True)).status == "ok"

    asyncio.run(setup())
    return store


def _owner(
    tmp_path: Path,
    size: int,
    *learners: str,
    config: JobConfig | None = None,
    store: MemoryControlStore | None = None,
) -> FragmentOwner:
    """The owner of fragment 0 of `size` values, as replica "r" at epoch 1, in a job kept
    in memory (`_store`, with `learners`)."""
    return FragmentOwner(
        fragment=0,
        size=size,
        segments=(size,),
        epoch=1,
        replica="r",
        config=config or JobConfig(max_weight_share=2.0),
        store=store or _store(*learners),
        tensors=TensorStore(str(tmp_path)),
        tape=Tape(None, "r"),
        fragments=1,
    )


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
    sealed = owner.sums.current
    # claims c_tokens^2 / c_steps = 1000; began when no other weight was known
    late = Update("late", "i", 1, 0, 10, 100, 1.0, 1000.0, (1.0,), codec, 64, sealed)
    late.provisional = True
    owner.open.stream(late)
    for s in codecs.encode_segments(codec, x, 64, 400)[0]:
        owner.sums.add_now(late, s.offset, s.count, s.data)
    assert sealed.provisional is not None
    owner.guards.weights = Recent(
        {"a": 1.0, "b": 3.0, "late": 1000.0}
    )  # received meanwhile (not its own)
    _, got = owner.seal()
    assert got is sealed
    assert late.moved is not None
    late.moved.result(timeout=30)
    assert not late.provisional
    assert late.weight == 4.0  # 2 x the median of 1 and 3
    assert late.accumulator is owner.sums.current
    assert owner.sums.current.provisional is None
    decoded = codec.decode(codec.encode(x, 64), size, 64)
    np.testing.assert_allclose(owner.sums.current.total, 4.0 * decoded, rtol=1e-6, atol=1e-6)
    assert sealed.provisional.taken_out == 1000.0  # the sum it left says what left it
    np.testing.assert_allclose(sealed.provisional.total, 0.0, atol=1e-3)
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
        update = Update(name, "i", 1, 0, 10, 100, 1.0, 1.0, (1.0,), codec, 64, owner.sums.current)
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
    update = Update("a", "i", 1, 0, 10, 100, 1.0, 1.0, (1.0,), codec, 64, owner.sums.current)
    owner.open.stream(update)

    async def run() -> tuple[float, int]:
        await owner.add(update, segments[0].offset, segments[0].count, segments[0].data)
        gate = threading.Event()
        owner.sums.worker.submit(gate.wait)  # the worker busy with other updates' sums
        queued = [owner.add(update, s.offset, s.count, s.data) for s in segments[1:]]
        abandoning = asyncio.ensure_future(owner.abandon(update))
        await asyncio.sleep(0)
        _, sealed = owner.seal()  # a round sealed right after: its step jumps the queue
        step_read = owner.sums.worker.urgent(lambda: float(sealed.total.sum()))
        gate.set()
        seen = await asyncio.wrap_future(step_read)
        sealed.release()  # as a merge does once its step has read the sum
        await abandoning
        await asyncio.gather(*queued)
        return seen, len(update.chunks)

    seen, chunks = asyncio.run(run())
    assert seen == 0.0  # none of the abandoned update's values reached the step
    assert chunks == 0  # its queued chunk sums added nothing after
    np.testing.assert_array_equal(owner.sums.current.total, np.zeros(size, np.float32))
    owner.close()


def test_an_update_received_while_its_move_is_queued_joins_the_next_round_as_moved(
    tmp_path: Path,
) -> None:
    """Its round sealed while Redis recorded it: the move that settles its provisional
    weight is still queued behind other work on the worker. Receiving it waits for that
    move, so it is counted in the next round at the weight its values were moved at."""
    size = 1000
    owner = _owner(tmp_path, size, "late")
    codec = codecs.by_name("int8")
    x = np.random.default_rng(5).normal(size=size).astype(np.float32)
    late = Update("late", "i", 1, 0, 10, 100, 1.0, 1000.0, (1.0,), codec, 64, owner.sums.current)
    late.provisional = True
    owner.open.stream(late)
    for s in codecs.encode_segments(codec, x, 64, 400)[0]:
        owner.sums.add_now(late, s.offset, s.count, s.data)
    owner.guards.weights = Recent({"a": 1.0, "b": 3.0})

    async def run() -> tuple[str, int]:
        started, gate = threading.Event(), threading.Event()

        def busy() -> None:  # the worker busy: the move waits behind this job
            started.set()
            gate.wait()

        owner.sums.worker.submit(busy)
        await asyncio.to_thread(started.wait, 30)
        owner.seal()
        receiving = asyncio.ensure_future(owner.receive(late, 0))
        await asyncio.sleep(0.05)
        assert not receiving.done()  # waiting for its move
        gate.set()
        return await receiving

    assert asyncio.run(run()) == ("received", 0)
    assert late in owner.open.members
    assert not late.provisional
    assert owner.sums.current.weight == 4.0  # counted, at the weight it was moved at
    assert owner.guards.weights["late"] == 4.0
    owner.close()


def test_an_update_over_the_clip_bound_merges_scaled_down_and_its_clipped_norm_is_kept(
    tmp_path: Path,
) -> None:
    """Measured against the other slot's last accepted norm (1.0, 10 steps), an update of
    norm 10 over as many steps is scaled to 3 (--clip-norm-ratio), not refused: its sum holds
    0.3 of its values, and the norm it leaves for the next updates is the clipped one."""
    size = 1000
    owner = _owner(tmp_path, size, "evil")
    codec = codecs.by_name("fp32")
    x = np.random.default_rng(6).normal(size=size).astype(np.float32)
    x *= np.float32(10.0 / np.linalg.norm(x.astype(np.float64)))
    owner.guards.norms.set("honest", 1.0, 10)
    assert owner.guards.clip_bound("evil", 10) == 3.0
    # Alone: the warm-up bound.
    assert owner.guards.clip_bound("honest", 10) == 0.05 * math.sqrt(size)
    big = Update("evil", "i", 1, 0, 10, 100, 1.0, 2.0, (10.0,), codec, 0, owner.sums.current)
    owner.open.stream(big)
    for s in codecs.encode_segments(codec, x, 0, 400)[0]:
        owner.sums.add_now(big, s.offset, s.count, s.data)

    assert asyncio.run(owner.receive(big, 0)) == ("received", 0)
    assert math.isclose(big.clip, 0.3, rel_tol=1e-6)
    np.testing.assert_allclose(owner.sums.current.total, 2.0 * 0.3 * x, rtol=1e-5, atol=1e-6)
    assert owner.sums.current.weight == 2.0  # its weight is its own: only its values shrank
    assert math.isclose(owner.guards.norms["evil"], 3.0, rel_tol=1e-5)
    owner.close()


def _evil_against(owner: FragmentOwner, honest_share: float) -> tuple[Update, np.ndarray, float]:
    """An fp32 update of "evil" summed into `owner`'s open round, beside an honest slot's
    history of `honest_share` times its norm: the update, its values and their norm."""
    codec = codecs.by_name("fp32")
    x = np.random.default_rng(8).normal(size=owner.size).astype(np.float32)
    norm = float(np.linalg.norm(x.astype(np.float64)))
    owner.guards.norms.set("honest", norm * honest_share, 10)
    big = Update("evil", "i", 1, 0, 10, 100, 1.0, 1.0, (norm,), codec, 0, owner.sums.current)
    owner.open.stream(big)
    for s in codecs.encode_segments(codec, x, 0, 400)[0]:
        owner.sums.add_now(big, s.offset, s.count, s.data)
    return big, x, norm


def test_under_radial_merging_a_clipped_update_keeps_its_direction_and_counts_clipped_norms(
    tmp_path: Path,
) -> None:
    """Radial merging sums unit vectors: a clip scales the norms an update is counted with
    (the round's length), not its values (its direction)."""
    owner = _owner(tmp_path, 1000, "evil", config=JobConfig(merge="radial"))
    # The bound: 3x a fifth of its norm, 0.6 of it (under 10x: clipped, not dropped).
    big, x, norm = _evil_against(owner, 1 / 5)

    assert asyncio.run(owner.receive(big, 0)) == ("received", 0)
    assert math.isclose(big.clip, 0.6, rel_tol=1e-5)
    np.testing.assert_allclose(owner.sums.current.total, x / norm, rtol=1e-5, atol=1e-7)  # unit
    radial = owner.sums.current
    assert isinstance(radial, Radial)
    assert math.isclose(float(radial.norm_sum[0]), 0.6 * norm, rel_tol=1e-5)
    owner.close()


def test_an_update_ten_times_the_others_merges_at_no_weight_as_its_rounds_member(
    tmp_path: Path,
) -> None:
    """Past --max-update-norm-ratio (10) times the other slots' recent norms, under the
    fragment-size floor that refuses outright: taken out of the sum, recorded, counted in
    its round at no weight (a slot replacing a fragment once merged clipped every round)."""
    owner = _owner(tmp_path, 1000, "evil")
    big, _, norm = _evil_against(owner, 1 / 30)

    assert asyncio.run(owner.receive(big, 0)) == ("received", 0)
    assert big.clip == 0.0
    assert not owner.sums.current.total.any()
    assert owner.sums.current.weight == 0.0
    assert owner.guards.norms.median_of_others("x") == norm / 30  # its norm moved no bar
    owner.close()


def _send(owner: FragmentOwner, learner: str, seq: int, x: np.ndarray) -> Update:
    """An update of `learner` begun, summed chunk by chunk and checked, as Ingest does."""
    codec = codecs.by_name("fp32")
    update = owner.begin(
        learner=learner,
        incarnation="i",
        seq=seq,
        base_version=owner.version or 0,
        c_steps=10,
        c_tokens=100,
        compute_seconds=1.0,
        norms=[float(np.linalg.norm(x.astype(np.float64)))],
        codec=codec,
        block_size=0,
    )
    for s in codecs.encode_segments(codec, x, 0, 400)[0]:
        owner.sums.add_now(update, s.offset, s.count, s.data)
    return update


def test_an_owner_takes_its_first_values_merges_a_round_and_commits_it(tmp_path: Path) -> None:
    """First values written and loaded; two learners' updates received (recorded in the
    control store; the first provisional, no weight known before it), the round merged: the
    pointer moves to version 1, the log names both updates, the value moved by -lr times
    their mean, and a resend of a merged update is a duplicate."""
    size, lr = 1000, 0.5
    store = _store("a", "b", initialized=False)
    owner = _owner(tmp_path, size, store=store, config=JobConfig(outer_lr=lr))
    rng = np.random.default_rng(9)
    xs = [rng.normal(scale=0.01, size=size).astype(np.float32) for _ in range(2)]

    async def run() -> None:
        start = np.ones(size, np.float32)
        value, state = await owner.initial_state(start)
        assert await store.init_fragment(0, value, state)
        await owner.load(await store.pointer(0))
        assert owner.version == 0
        for k, (learner, x) in enumerate(zip("ab", xs, strict=True)):
            update = _send(owner, learner, k, x)
            assert update.provisional == (learner == "a")  # no weight known before it
            assert await owner.receive(update, k) == ("received", 0)
        assert await store.pending(1) == ["a/i/0", "b/i/1"]
        await owner.merge(None)
        pointer = await store.pointer(0)
        assert pointer is not None
        assert pointer.version == 1
        assert owner.version == 1
        (entry,) = await store.log_range(0, 0, 1)
        assert entry["uids"] == ["a/i/0", "b/i/1"]
        assert await store.pending(1) == []
        moved = owner.committed.theta + owner.committed.residual
        np.testing.assert_allclose(moved, start - lr * (xs[0] + xs[1]) / 2, atol=1e-6)
        again = _send(owner, "a", 0, xs[0])
        assert await owner.receive(again, 0) == ("duplicate", 1)

    asyncio.run(run())
    owner.close()


def test_an_update_shrinking_the_fragment_merges_at_no_weight_from_its_first_round(
    tmp_path: Path,
) -> None:
    """In the fragment's first round (no direction, no other slot's norm yet), an update of
    0.99 times the fragment (a slot replacing it with a small vector) agrees with the
    fragment's own signs at about 1: it is recorded and merges at no weight; an honest
    update beside it agrees at about 0 and takes its full step. One that grows the fragment
    (-5 times it) is not judged by its shrink (honest ones grow it early in training): the
    warm-up bound clips it, and at sealing, 100 times the honest member beside it, it is
    dropped for its norm (over --max-update-norm-ratio times the round's other members)."""
    size, lr = 4000, 0.5
    store = _store("honest", "shrink", "grow", initialized=False)
    owner = _owner(tmp_path, size, store=store, config=JobConfig(outer_lr=lr))
    rng = np.random.default_rng(11)
    start = rng.normal(scale=0.02, size=size).astype(np.float32)
    honest = rng.normal(scale=0.001, size=size).astype(np.float32)
    grow = (-5.0 * start).astype(np.float32)

    async def run() -> None:
        value, state = await owner.initial_state(start)
        assert await store.init_fragment(0, value, state)
        await owner.load(await store.pointer(0))
        sent = {}
        for k, (learner, x) in enumerate(
            (("shrink", 0.99 * start), ("grow", grow), ("honest", honest))
        ):
            sent[learner] = _send(owner, learner, k, x.astype(np.float32))
            assert await owner.receive(sent[learner], k) == ("received", 0)
        shrink = {who: u.shrink if u.shrink is not None else math.nan for who, u in sent.items()}
        assert shrink["shrink"] > 0.99
        assert shrink["grow"] < -0.99
        assert abs(shrink["honest"]) < 0.1
        assert sent["shrink"].clip == 0.0
        assert 0.0 < sent["grow"].clip < 1.0  # the warm-up bound, 0.05 per value, clips it
        assert sent["honest"].clip == 1.0
        await owner.merge(None)
        assert sent["grow"].clip == 0.0
        (entry,) = await store.log_range(0, 0, 1)
        assert entry["learners"] == ["shrink", "grow", "honest"]  # members, all three
        assert entry["clips"] == [0.0, 0.0, 1.0]
        moved = owner.committed.theta + owner.committed.residual
        np.testing.assert_allclose(moved, start - lr * honest, atol=1e-6)

    asyncio.run(run())
    owner.close()


def test_in_sync_mode_a_slot_refused_for_its_norm_does_not_stop_the_job(tmp_path: Path) -> None:
    """A sync round waits for every slot of the job (quorum 3 here); a slot whose update was
    refused for its norm is not waited for: the two honest slots' updates merge."""
    size = 1000
    store = _store("a", "b", "evil", initialized=False)
    config = JobConfig(mode="sync", quorum=3)
    owner = _owner(tmp_path, size, store=store, config=config)
    rng = np.random.default_rng(12)

    async def run() -> None:
        value, state = await owner.initial_state(rng.normal(size=size).astype(np.float32))
        assert await store.init_fragment(0, value, state)
        await owner.load(await store.pointer(0))
        for k, learner in enumerate("ab"):
            x = rng.normal(scale=0.01, size=size).astype(np.float32)
            assert await owner.receive(_send(owner, learner, k, x), k) == ("received", 0)
        live = Live(
            now_s=0.0,
            learners=tuple(LiveLearner(who, 0.5, False, None) for who in ("a", "b", "evil")),
        )
        await owner.evaluate(live)
        assert owner.version == 0  # waiting for the job's third slot
        owner.refused("evil", "norm")
        await owner.evaluate(live)
        assert owner.version == 1

    asyncio.run(run())
    owner.close()


class FirstRound:
    """A fragment's first round: `factor` times an honest update from slot evil arriving
    first (provisional: no other slot's norm to measure it against), then two honest ones."""

    def __init__(self, tmp_path: Path, factor: float, lr: float = 0.5, size: int = 4000) -> None:
        self.size, self.lr = size, lr
        self.store = _store("evil", "a", "b", initialized=False)
        self.owner = _owner(tmp_path, size, store=self.store, config=JobConfig(outer_lr=lr))
        rng = np.random.default_rng(13)
        self.start = rng.normal(scale=0.02, size=size).astype(np.float32)
        self.honest = [rng.normal(scale=0.001, size=size).astype(np.float32) for _ in range(2)]
        self.evil = (factor * rng.normal(scale=0.001, size=size)).astype(np.float32)

    async def send(self) -> Update:
        """The round's three updates, received; evil's as it was clipped on receipt."""
        owner = self.owner
        value, state = await owner.initial_state(self.start)
        assert await self.store.init_fragment(0, value, state)
        await owner.load(await self.store.pointer(0))
        first = _send(owner, "evil", 0, self.evil)
        assert first.provisional
        assert await owner.receive(first, 0) == ("received", 0)
        for k, x in enumerate(self.honest, start=1):
            assert await owner.receive(_send(owner, "ab"[k - 1], k, x), k) == ("received", 0)
        return first

    def moved(self) -> np.ndarray:
        return self.owner.committed.theta + self.owner.committed.residual


def test_an_update_first_in_a_fragments_first_round_is_clipped_against_the_round_at_sealing(
    tmp_path: Path,
) -> None:
    """With no other slot's update to measure it against, an update 5 times an honest one
    arriving first is clipped only to the warm-up bound; once its round is sealed, against
    the two honest members beside it: to 3x (--clip-norm-ratio) their median norm, and the
    fragment moves by the three members' mean with it so clipped."""
    r = FirstRound(tmp_path, 5.0)

    async def run() -> None:
        first = await r.send()
        assert first.clip == 1.0  # within the warm-up bound
        await r.owner.merge(None)
        norms = sorted(float(np.linalg.norm(x.astype(np.float64))) for x in r.honest)
        bound = 3.0 * (norms[0] + norms[1]) / 2
        assert math.isclose(first.clip * first.norm, bound, rel_tol=1e-4)
        (entry,) = await r.store.log_range(0, 0, 1)
        assert entry["clips"][0] == pytest.approx(first.clip)
        want = r.start - r.lr * (r.honest[0] + r.honest[1] + first.clip * r.evil) / 3
        np.testing.assert_allclose(r.moved(), want, atol=1e-5)

    asyncio.run(run())
    r.owner.close()


def test_an_update_first_in_a_fragments_first_round_far_over_the_round_is_dropped_at_sealing(
    tmp_path: Path,
) -> None:
    """An update 100 times an honest one arriving first is clipped only to the warm-up bound;
    once its round is sealed it is over --max-update-norm-ratio (10) times the median of the
    two honest members beside it, and merges at no weight, standing for nothing: the
    fragment moves by the honest pair's mean at 2/3 of a step (three live slots). Clipped to
    3x the others instead, it merged as three times an honest update."""
    r = FirstRound(tmp_path, 100.0)

    async def run() -> None:
        first = await r.send()
        warmup = r.owner.config.warmup_update_rms * math.sqrt(r.size)
        assert math.isclose(first.clip * first.norm, warmup, rel_tol=1e-5)
        await r.owner.merge(frozenset({"evil", "a", "b"}))
        assert first.clip == 0.0
        assert "evil" not in r.owner.guards.norms  # a dropped one moves no bar
        (entry,) = await r.store.log_range(0, 0, 1)
        assert entry["clips"][0] == 0.0
        assert entry["scale"] == pytest.approx(2 / 3)
        want = r.start - r.lr * (2 / 3) * (r.honest[0] + r.honest[1]) / 2
        np.testing.assert_allclose(r.moved(), want, atol=1e-5)

    asyncio.run(run())
    r.owner.close()


def test_a_refused_update_is_taken_out_of_the_round_and_leaves_no_record(tmp_path: Path) -> None:
    """An update whose slot a newer incarnation took over is refused by the control store
    after summing: its values leave the round's sum, and the round has no member."""
    size = 1000
    store = _store("a")
    owner = _owner(tmp_path, size, store=store)
    x = np.random.default_rng(10).normal(scale=0.01, size=size).astype(np.float32)

    async def run() -> None:
        await store.leave("a", "i", 1)
        assert (await store.hello("[]", "a", "j", 3600, 0, True)).status == "ok"
        update = _send(owner, "a", 0, x)
        assert await owner.receive(update, 0) == ("superseded", 0)
        assert not owner.open.members
        assert await store.pending(1) == []

    asyncio.run(run())
    assert owner.sums.current.provisional is not None
    np.testing.assert_allclose(owner.sums.current.provisional.total, 0.0, atol=1e-7)
    owner.close()


def test_an_update_is_not_checked_against_a_direction_its_own_slot_made_alone(
    tmp_path: Path,
) -> None:
    """A learner alone on a fragment is not dropped for pointing against its own last
    update (a slot's own history never moves its bar: one learner's consecutive outer
    gradients are nearly uncorrelated late in training, and a job of one learner lost its
    honest updates). Once a round of two slots made the direction, the same update is."""
    size = 4000
    store = _store("a", "b", initialized=False)
    owner = _owner(tmp_path, size, store=store)
    rng = np.random.default_rng(17)
    start = rng.normal(scale=0.02, size=size).astype(np.float32)
    x = rng.normal(scale=0.001, size=size).astype(np.float32)

    async def run() -> None:
        value, state = await owner.initial_state(start)
        assert await store.init_fragment(0, value, state)
        await owner.load(await store.pointer(0))
        assert await owner.receive(_send(owner, "a", 0, x), 0) == ("received", 0)
        await owner.merge(None)
        assert owner.committed.direction_from == {"a"}
        alone = _send(owner, "a", 1, -x)
        assert await owner.receive(alone, 1) == ("received", 1)
        assert alone.agreement is None  # not checked
        assert alone.clip == 1.0
        # A round of both slots makes the direction; a's update against it is dropped.
        await owner.merge(None)
        for k, learner in enumerate("ab"):  # along the direction a's last update made
            update = _send(owner, learner, 2 + k, -x)
            assert await owner.receive(update, 2 + k) == ("received", 2)
            assert update.clip == 1.0
        await owner.merge(None)
        assert owner.committed.direction_from == {"a", "b"}
        against = _send(owner, "a", 4, x)
        assert await owner.receive(against, 4) == ("received", 3)
        assert against.agreement == pytest.approx(-1.0)
        assert against.clip == 0.0

    asyncio.run(run())
    owner.close()
