"""`atoll up`'s decisions made before any process starts: --regions and --data-parallel."""

from __future__ import annotations

import pytest

from cluster.settings import UpSettings, data_parallel, refused


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
