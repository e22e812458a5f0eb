"""`atoll bench quality`: the gpu preset's sizes, and the whole bench at its cpu-smoke size."""

from __future__ import annotations

import json
import subprocess
import sysconfig
from pathlib import Path

import pytest

from bench.quality import QualityBench, eval_command, fingerprints, gaps, rows, run, steps_of
from cluster.processes import atoll_command
from learner.model import TransformerConfig


def test_the_gpu_preset_trains_30m_parameters_on_20_tokens_each_with_two_seeds() -> None:
    bench = QualityBench(scale="gpu")
    model = TransformerConfig(bench.layers, bench.width, bench.heads, bench.context)
    assert 30e6 <= model.parameters <= 50e6
    assert (bench.learners, bench.gpus_per_learner) == (2, 1)
    steps = steps_of(bench)
    assert steps * bench.learners * bench.batch_size * bench.context >= 20 * model.parameters
    assert len(bench.seeds) >= 2
    # A flag given wins over the preset.
    assert QualityBench(scale="gpu", layers=2, codecs=["sign"]).layers == 2
    assert QualityBench(scale="gpu", codecs=["sign"]).codecs == ["sign"]
    # Exported models are scored as the runs were: the held-out files, the same windows.
    args = eval_command(bench, Path("m.safetensors"))
    assert "--held-out" in args
    assert args[args.index("--windows") + 1] == "1024"


def test_gaps_are_of_means_against_dp_and_sync_and_say_if_they_beat_the_spread() -> None:
    def one(loss: float, seed: int, ood: float | None = None) -> dict[str, object]:
        out = {"eval_loss": loss, "seed": seed, "bandwidth_reduction": 1, "goodput": 1.0}
        return {**out, "wall_seconds": 1.0, "ood_loss": ood}

    runs = {
        "dp/seed0": one(1.0, 0, 2.0),
        "dp/seed1": one(1.02, 1, 2.0),
        "sync-fp32-h10/seed0": one(1.1, 0, 2.2),
        "sync-fp32-h10/seed1": one(1.12, 1, 2.2),
        "decoupled-int4-h10/seed0": one(1.0, 0),
        "decoupled-int4-h10/seed1": one(1.04, 1),
    }
    table = rows(runs)
    assert table["dp"]["eval_loss"] == {
        "mean": 1.01,
        "min": 1.0,
        "max": 1.02,
        "spread": 0.02,
        "n": 2,
    }
    found = gaps(table)
    assert found["sync-fp32-h10_vs_dp"] == {"gap": round(0.1 / 1.01, 4), "beyond_spread": True}
    assert found["sync-fp32-h10_vs_dp_ood"] == {"gap": 0.1, "beyond_spread": True}
    # 1.02 against 1.01, with spreads of 0.04 and 0.02: noise, and said so.
    assert found["decoupled-int4-h10_vs_dp"]["beyond_spread"] is False
    assert "decoupled-int4-h10_vs_dp_ood" not in found  # no ood loss in that row
    assert found["decoupled-int4-h10_vs_sync-fp32-h10"]["gap"] < 0


def test_runs_that_trained_on_other_windows_are_caught() -> None:
    def one(seed: int, trained: str, evaluated: str = "e") -> dict[str, object]:
        data = {"trained": {"fingerprint": trained}, "evaluated": evaluated}
        return {"seed": seed, "data": data}

    same = {"dp/seed0": one(0, "a"), "sync/seed0": one(0, "a"), "dp/seed1": one(1, "b")}
    assert fingerprints(same)["equal"] is True
    assert fingerprints({**same, "sync/seed1": one(1, "c")})["equal"] is False
    assert fingerprints({**same, "sync/seed1": one(1, "b", "other")})["equal"] is False


@pytest.mark.timeout(900)
def test_the_cpu_smoke_bench_trains_every_kind_on_the_same_windows_and_scores_exports(
    tmp_path: Path,
) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prose = tmp_path / "prose"  # text nobody trained on, in files without a suffix
    prose.mkdir()
    (prose / "LICENSE").write_bytes((stdlib / "LICENSE.txt").read_bytes())
    out = tmp_path / "quality.json"
    proc = subprocess.run(
        [
            *atoll_command("bench", "quality"),
            "--scale",
            "cpu-smoke",
            "--data",
            json.dumps([str(stdlib / "email")]),
            "--eval-data",
            json.dumps([str(stdlib / "json")]),
            "--ood-data",
            json.dumps([str(prose)]),
            "--runs",
            json.dumps(["dp", "sync", "decoupled", "sanity"]),
            "--sanity-steps",
            "40",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    kinds = ["decoupled-int4-h10", "dp", "sync-fp32-h10"]
    assert sorted(runs) == sorted(f"{k}/seed{s}" for k in kinds for s in (0, 1))
    assert len({r["tokens"] for r in runs.values()}) == 1  # equal tokens
    # Equal text: within a seed every kind trained on the same windows (M learners' batches
    # together hold data-parallel's), across seeds other ones; all scored on the same.
    trained = result["fingerprints"]["trained"]
    for seed in ("0", "1"):
        assert set(trained[seed]) == set(kinds)
        assert len(set(trained[seed].values())) == 1, trained
    assert trained["0"]["dp"] != trained["1"]["dp"]
    assert len(set(result["fingerprints"]["evaluated"].values())) == 1
    assert result["fingerprints"]["equal"] is True
    assert result["text"]["split"] == "windows"
    assert result["text"]["capped"] is False
    for one in runs.values():
        # The score is the exported final global model's, on both texts; the run's own
        # final eval is of the newest model a learner saw.
        assert 0 < one["eval_loss"] < 6
        assert 0 < one["ood_loss"] < 6
        assert (
            one["data"]["trained"]["windows"]
            == result["tokens_per_run"] // result["model"]["context"]
        )
    assert runs["dp/seed0"]["eval_loss"] == pytest.approx(runs["dp/seed0"]["eval_loss_run"], 1e-3)
    assert runs["decoupled-int4-h10/seed0"]["bandwidth_reduction"] > 1
    assert set(result["rows"]) == set(kinds)
    assert all(row["eval_loss"]["n"] == 2 for row in result["rows"].values())
    assert {"sync-fp32-h10_vs_dp", "decoupled-int4-h10_vs_dp_ood"} <= set(result["gaps"])
    assert result["best_decoupled"] == "decoupled-int4-h10"
    # One learner through the decoupled path, every merge the identity, trains as it would
    # alone, step by step (a late reply once made an honest update be refused as too large
    # and its steps lost).
    sanity = result["sanity"]
    assert sanity["compared_steps"] >= 30
    assert sanity["max_abs_loss_diff"] < 1e-3, sanity


def test_a_baseline_of_other_sizes_is_refused(tmp_path: Path) -> None:
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"scale": "gpu", "learners": 2, "steps": 10, "runs": {}}))
    with pytest.raises(ValueError, match="not comparable"):
        run(QualityBench(scale="gpu", runs=["decoupled"], baseline=earlier))
