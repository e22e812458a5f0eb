"""`atoll up`'s decisions made before any process starts: --regions and --data-parallel."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from cluster.launch import flags
from cluster.settings import UpSettings, data_parallel, refused
from services import codec as codecs
from services.config import HelpFormat, JobConfig, SynchronizerSettings
from services.tape import Tape
from synchronizer.owner import FragmentOwner
from synchronizer.store.memory_store import MemoryControlStore
from synchronizer.store.tensors import TensorStore


def settings(**values: object) -> UpSettings:
    return UpSettings.model_validate(values)


def test_data_parallel_is_one_learner_with_every_slots_batch_and_an_identity_merge() -> None:
    dp = data_parallel(
        settings(learners=2, batch_size=8, steps=100, eval_every=0, data_parallel=True)
    )
    assert (dp.learners, dp.batch_size, dp.mode) == (1, 16, "sync")
    assert (dp.fragments, dp.inner_steps) == (1, 100)  # one sync, at the end
    # Evaluated along the way: synced as often, so the global model is the learner's.
    assert data_parallel(settings(steps=100, eval_every=20)).inner_steps == 20
    assert (dp.codec, dp.downlink_codec, dp.outer_lr, dp.outer_momentum) == (
        "fp32",
        "fp32",
        1.0,
        0.0,
    )


def test_data_parallels_merge_is_the_identity_for_every_update_of_its_lone_learner(
    tmp_path: Path,
) -> None:
    """The data-parallel reference syncs its one learner every --eval-every steps, and its
    evals read the global model: each version must be the learner's own parameters. With the
    synchronizer's defences against hostile slots on, an honest update that pointed against
    the last merged one (late in training, consecutive outer gradients of one learner are
    nearly uncorrelated) or moved the values toward zero merged at no weight, and one over
    the warm-up RMS (a slot alone on its fragment) merged scaled down: the version equalled
    the one before (or fell short), the learner adopted it, and its evals repeated a stale
    loss. As the synchronizer takes the job from `atoll up`'s flags, every update is merged
    whole (outer lr 1: the fragment moves by exactly minus the update)."""
    dp = data_parallel(settings(regions="us:1,eu:1", steps=400, eval_every=50, data_parallel=True))
    args = flags(dp.model_copy(update={"quorum": 1}), JobConfig.model_fields)
    config = SynchronizerSettings(_cli_settings_source=HelpFormat(SynchronizerSettings)(args=args))
    size = 4000
    store = MemoryControlStore("job")
    owner = FragmentOwner(
        fragment=0,
        size=size,
        segments=(size,),
        epoch=1,
        replica="r",
        config=config,
        store=store,
        tensors=TensorStore(str(tmp_path)),
        tape=Tape(None, "r"),
        fragments=1,
    )
    rng = np.random.default_rng(5)
    start = rng.normal(scale=0.02, size=size).astype(np.float32)
    first = rng.normal(scale=0.03, size=size).astype(np.float32)
    updates = [
        first,
        # Back along the first (agreement about -1), toward zero (shrink about 1).
        (-0.5 * first + rng.normal(scale=0.003, size=size)).astype(np.float32),
        # RMS 0.1 per value: over the warm-up bound (0.05) that clips a slot alone.
        rng.normal(scale=0.1, size=size).astype(np.float32),
    ]
    fp32 = codecs.by_name("fp32")

    async def run() -> None:
        assert (await store.own("acquire", 0, "r", ttl_s=3600)) == ("owned", 1)
        assert (await store.hello("[]", "learner-0", "i", 3600, 0, True)).status == "ok"
        value, state = await owner.initial_state(start)
        assert await store.init_fragment(0, value, state)
        await owner.load(await store.pointer(0))
        want = start.copy()
        for seq, x in enumerate(updates):
            update = owner.begin(
                learner="learner-0",
                incarnation="i",
                seq=seq,
                base_version=owner.version or 0,
                c_steps=50,
                c_tokens=6400,
                compute_seconds=1.0,
                norms=[float(np.linalg.norm(x.astype(np.float64)))],
                codec=fp32,
                block_size=0,
            )
            for s in codecs.encode_segments(fp32, x, 0, 4000)[0]:
                owner.sums.add_now(update, s.offset, s.count, s.data)
            assert await owner.receive(update, seq) == ("received", seq)
            await owner.merge(None)
            assert owner.version == seq + 1
            (entry,) = await store.log_range(0, seq, seq + 1)
            assert entry["clips"] == [1.0], f"version {seq + 1}: {entry}"
            assert entry["scale"] == 1.0
            want = want - x
            moved = owner.committed.theta + owner.committed.residual
            np.testing.assert_allclose(moved, want, atol=1e-6)

    try:
        asyncio.run(run())
    finally:
        owner.close()


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"data_parallel": True}, "--data-parallel runs across --regions"),
        ({"link": "rate=10mbit"}, "--link shapes the links of --regions"),
        ({"regions": "us:2", "learners": 3}, "places 2 learners, --learners says 3"),
        ({"regions": "us:1,eu:1", "tls": True}, "drop --tls"),
        ({"regions": "us:1", "redis_url": "redis://x:1/0"}, "drop --redis-url"),
        ({"regions": "us:1", "link": "rate=fast"}, "--link needs rate=RATE"),
        (
            {"regions": "us:1,eu:1", "data_parallel": True, "chaos": "net-reset:mtbf=9s"},
            "--data-parallel runs one learner of one process per slot; drop --chaos",
        ),
    ],
)
def test_what_regions_cannot_run_with_is_refused_before_anything_starts(
    values: dict[str, object], says: str
) -> None:
    problem = refused(settings(**values))
    assert problem is not None
    assert says in problem
