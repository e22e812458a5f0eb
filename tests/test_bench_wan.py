"""`atoll bench wan`'s arithmetic, on made-up runs: the curve, the time to a loss, the share
of throughput kept, and the runs it plans."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.wan import (
    WanBench,
    common_flags,
    eval_curve,
    planned,
    plot_race,
    result,
    throughput_kept,
    time_to_loss,
)


def test_the_curve_puts_every_learners_evaluations_on_the_runs_clock() -> None:
    summaries = [
        {"started_at": 102.0, "evals": [[10.0, 20, 0, 3.0], [30.0, 60, 0, 2.5]]},
        {"started_at": 105.0, "evals": [[15.0, 40, 0, 2.8]]},
    ]
    assert eval_curve(summaries, started_at=100.0) == [[12.0, 3.0], [20.0, 2.8], [32.0, 2.5]]


def test_time_to_loss_is_the_first_point_within_the_tolerance_or_none() -> None:
    curve = [[5.0, 3.0], [9.0, 2.03], [12.0, 1.9]]
    assert time_to_loss(curve, 2.0, tolerance=0.01) == 12.0
    assert time_to_loss(curve, 2.0, tolerance=0.02) == 9.0
    assert time_to_loss(curve, 1.0, tolerance=0.01) is None
    assert throughput_kept(0.96, 1.0) == 0.96
    assert throughput_kept(1.0, 0.0) is None


def run_of(wall: float, final: float, curve: list[list[float]], rate: float) -> dict[str, Any]:
    return {
        "wall_seconds": wall,
        "final_eval_loss": final,
        "eval_curve": curve,
        "steps_per_s_per_learner": rate,
    }


def test_the_result_races_decoupled_and_sync_to_dps_final_loss(tmp_path: Path) -> None:
    settings = WanBench.model_validate({"json": None})
    runs = {
        "dp": run_of(1000.0, 2.0, [[500.0, 2.5], [1000.0, 2.0]], 0.1),
        "decoupled": run_of(120.0, 2.01, [[50.0, 2.4], [90.0, 2.01]], 0.98),
        "sync": run_of(400.0, 2.3, [[400.0, 2.3]], 0.5),
        "uncapped": run_of(110.0, 2.0, [[100.0, 2.0]], 1.0),
    }
    race = result(settings, runs)
    assert race["dp_final_eval_loss"] == 2.0
    assert race["runs"]["decoupled"]["time_to_dp_loss_s"] == 90.0
    assert race["runs"]["decoupled"]["time_to_dp_loss_of_dp_wall"] == 0.09
    assert race["runs"]["sync"]["time_to_dp_loss_s"] is None
    assert race["throughput_kept"] == 0.98
    plot_race(race, tmp_path / "race.png")
    assert (tmp_path / "race.png").stat().st_size > 10_000


def test_the_runs_share_the_regions_and_text_and_differ_in_link_and_mode() -> None:
    settings = WanBench.model_validate({"json": None, "rate": "50mbit", "delay": "40ms"})
    plans = dict(planned(settings))
    assert list(plans) == ["dp", "decoupled", "sync", "uncapped"]
    assert plans["dp"][:2] == ["--link", "rate=50mbit,delay=40ms"]
    assert "--data-parallel" in plans["dp"]
    assert plans["dp"][-2:] == ["--param-layout", "replicated"]  # classic data-parallel
    sharded = WanBench.model_validate({"json": None, "dp_param_layout": "sharded"})
    assert dict(planned(sharded))["dp"][-2:] == ["--param-layout", "sharded"]
    assert plans["uncapped"][:2] == ["--link", "rate=100gbit"]
    assert plans["uncapped"][2:] == plans["decoupled"][2:]


def test_each_side_has_its_own_learning_rate() -> None:
    tuned = dict(planned(WanBench.model_validate({"json": None, "lr": 0.006, "dp_lr": 0.012})))
    for name in ("decoupled", "sync", "uncapped"):
        flags = tuned[name]
        assert flags[flags.index("--lr") + 1] == "0.006"
    assert tuned["dp"][tuned["dp"].index("--lr") + 1] == "0.012"
    assert tuned["dp"].count("--lr") == 1
    untuned = dict(planned(WanBench.model_validate({"json": None})))
    assert all("--lr" not in flags for flags in untuned.values())


def test_the_downlink_codec_is_the_diloco_runs_alone_and_clipping_every_runs() -> None:
    settings = WanBench.model_validate({"json": None, "downlink_codec": "int4", "clip_norm": 0.5})
    plans = dict(planned(settings))
    for name in ("decoupled", "sync", "uncapped"):
        flags = plans[name]
        assert flags[flags.index("--downlink-codec") + 1] == "int4"
    assert "--downlink-codec" not in plans["dp"]  # data-parallel sends no global values
    common = common_flags(settings)
    assert common[common.index("--clip-norm") + 1] == "0.5"  # the same for every run
    assert "--clip-norm" not in common_flags(WanBench.model_validate({"json": None}))
