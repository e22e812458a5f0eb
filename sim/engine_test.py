"""Invariants of the simulator itself."""

from itertools import pairwise

import pytest

from sim.engine import Mode, simulate
from sim.main import CHIPS, table
from sim.model import DEFAULT

SHORT = DEFAULT.with_changes(horizon_s=3 * 24 * 3600.0)
MODES: list[tuple[Mode, int]] = [("dp", 1), ("elastic_dp", 1), ("decoupled", 8)]


@pytest.mark.parametrize(("mode", "learners"), MODES)
def test_without_failures_only_start_up_is_lost(mode: Mode, learners: int) -> None:
    calm = SHORT.with_changes(chip_mtbi_years=1e12)
    r = simulate(calm, mode, 600_000, learners)
    ideal = 1.0 - calm.startup_s / calm.horizon_s
    if mode == "dp":  # data-parallel pays its per-step checkpoint copies all the same
        ideal *= calm.checkpoint_interval_s / (calm.checkpoint_interval_s + calm.checkpoint_cost_s)
    assert r.goodput == pytest.approx(ideal, abs=2e-3)
    assert r.events["interruptions"] == 0


@pytest.mark.parametrize(("mode", "learners"), MODES)
def test_goodput_falls_with_chips_and_with_failure_rate(mode: Mode, learners: int) -> None:
    by_chips = [simulate(SHORT, mode, c, learners).goodput for c in CHIPS]
    assert all(a > b for a, b in pairwise(by_chips)), by_chips
    by_rate = [
        simulate(SHORT.with_changes(chip_mtbi_years=y), mode, 600_000, learners).goodput
        for y in (4.0, 2.0, 1.0, 0.5)
    ]
    assert all(a > b for a, b in pairwise(by_rate)), by_rate


def test_decoupled_goodput_rises_with_learners() -> None:
    by_m = [simulate(SHORT, "decoupled", 1_200_000, m).goodput for m in (2, 4, 8, 16, 32)]
    assert all(a < b for a, b in pairwise(by_m)), by_m


def test_the_same_seed_gives_the_same_numbers() -> None:
    one = simulate(SHORT, "decoupled", 300_000, 8, seed=3)
    assert one == simulate(SHORT, "decoupled", 300_000, 8, seed=3)
    assert one != simulate(SHORT, "decoupled", 300_000, 8, seed=4)


def test_a_quorum_above_the_live_learners_stalls_them() -> None:
    strict = SHORT.with_changes(quorum=8)
    loose = simulate(SHORT, "decoupled", 2_400_000, 8)
    stalled = simulate(strict, "decoupled", 2_400_000, 8)
    assert stalled.goodput < loose.goodput
    assert stalled.events["stalled_seconds"] > 0


def test_the_table_has_every_mode_at_every_scale() -> None:
    result = table(SHORT.with_changes(horizon_s=24 * 3600.0), seed=0)
    assert result["chips"] == CHIPS
    assert set(result["goodput"]) == {"dp", "elastic_dp", "decoupled_m8", "decoupled_m16"}
    for values in result["goodput"].values():
        assert len(values) == len(CHIPS)
        assert all(0.0 < v <= 1.0 for v in values)


def test_elastic_failures_share_re_shards_and_spares_ride_on_them() -> None:
    big = simulate(SHORT, "elastic_dp", 1_200_000)
    # Failures while the job is stalled or re-sharding join that re-shard.
    assert big.events["reshards"] < big.events["interruptions"]
    # With a failure every few seconds, replaced slices always join a failure's re-shard.
    assert big.events["grow_reshards"] == 0
    # A small job whose spare is an eighth of it waits until waiting costs a re-shard.
    small = simulate(SHORT.with_changes(chip_mtbi_years=0.01), "elastic_dp", 2048)
    assert small.events["grow_reshards"] > 0


# The paper's goodput table (%, per-chip mean time between interruptions one year) at CHIPS.
PUBLISHED: dict[tuple[Mode, int], list[float]] = {
    ("dp", 1): [72, 57, 38, 27, 18],
    ("decoupled", 8): [98, 96, 94, 88, 80],
}


@pytest.mark.parametrize(("mode", "learners"), list(PUBLISHED))
def test_the_calibrated_rows_are_within_3_points_of_the_paper(mode: Mode, learners: int) -> None:
    """`atoll sim --table`'s defaults (seed 0, 14 days), as docs/simulator.md shows them."""
    simulated = [100 * simulate(DEFAULT, mode, chips, learners, seed=0).goodput for chips in CHIPS]
    for chips, ours, paper in zip(CHIPS, simulated, PUBLISHED[mode, learners], strict=True):
        assert abs(ours - paper) <= 3.0, (mode, chips, round(ours, 1), paper)
