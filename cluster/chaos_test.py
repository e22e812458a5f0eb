from itertools import pairwise

import pytest

from cluster.chaos import ChaosError, parse, parse_duration, schedule


def test_durations() -> None:
    assert parse_duration("30s") == 30.0
    assert parse_duration("500ms") == 0.5
    assert parse_duration("2m") == 120.0
    assert parse_duration("7") == 7.0
    with pytest.raises(ChaosError, match="not a duration"):
        parse_duration("soon")


def test_spec_grammar() -> None:
    specs = parse("learner-kill:mtbf=30s,down=5s; learner-pause:at=10s+20s,for=2s,victim=1")
    assert [s.kind for s in specs] == ["learner-kill", "learner-pause"]
    assert specs[0].mtbf_s == 30.0
    assert specs[0].duration_s == 5.0
    assert specs[1].at_s == (10.0, 20.0)
    assert specs[1].victim == 1
    assert parse("redis-restart:mtbf=1m")[0].duration_s == 0.0


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("learner-explode:mtbf=1s", "unknown fault"),
        ("learner-kill:mtbf=1s,down=1s,color=red", "unknown keys"),
        ("learner-kill:down=1s", "either mtbf"),
        ("learner-kill:mtbf=1s,at=2s", "either mtbf"),
        ("learner-kill:mtbf", "key=value"),
        ("", "empty"),
    ],
)
def test_bad_specs_say_what_to_write(spec: str, match: str) -> None:
    with pytest.raises(ChaosError, match=match):
        parse(spec)


def test_schedule_is_reproducible_and_rate_is_cluster_wide() -> None:
    specs = parse("learner-kill:mtbf=30s,down=5s")
    one = schedule(specs, seed=1, horizon_s=3000, population={"learners": 4})
    assert one == schedule(specs, seed=1, horizon_s=3000, population={"learners": 4})
    assert one != schedule(specs, seed=2, horizon_s=3000, population={"learners": 4})
    # About horizon/mtbf faults whatever the cluster size.
    many = schedule(specs, seed=1, horizon_s=3000, population={"learners": 64})
    assert 70 <= len(one) <= 130
    assert 70 <= len(many) <= 130
    assert {f.victim for f in one} == {0, 1, 2, 3}
    assert all(a.at_s <= b.at_s for a, b in pairwise(one))


def test_a_victim_that_does_not_exist_is_refused() -> None:
    with pytest.raises(ChaosError, match="victim=5"):
        schedule(
            parse("learner-kill:at=1s,victim=5"), seed=0, horizon_s=10, population={"learners": 2}
        )
