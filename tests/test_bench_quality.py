"""`atoll bench quality`: the gpu preset's sizes, and the whole bench at its cpu-smoke size."""

from __future__ import annotations

import json
import subprocess
import sysconfig
from pathlib import Path

import pytest

from bench.quality import eval_command, gaps, run, steps_of
from bench.settings import QualityBench
from cluster.processes import atoll_command
from learner.model import TransformerConfig


def test_the_gpu_preset_is_gpt2_small_sized_for_200m_tokens() -> None:
    bench = QualityBench(scale="gpu")
    model = TransformerConfig(bench.layers, bench.width, bench.heads, bench.context)
    assert 85e6 <= model.parameters <= 125e6
    assert (bench.context, bench.learners, bench.gpus_per_learner) == (1024, 2, 1)
    steps = steps_of(bench)
    assert steps * bench.learners * bench.batch_size * bench.context >= 200e6
    assert bench.codecs == ["int4", "int2", "sign"]
    # A flag given wins over the preset.
    assert QualityBench(scale="gpu", layers=2, codecs=["sign"]).layers == 2
    assert QualityBench(scale="gpu", codecs=["sign"]).codecs == ["sign"]
    # Exported models are scored as the runs were: the held-out files, the same windows.
    args = eval_command(bench, Path("m.safetensors"))
    assert "--held-out" in args
    assert args[args.index("--windows") + 1] == "512"


def test_gaps_are_against_dp_and_against_sync_at_the_same_h() -> None:
    runs = {
        "dp": {"eval_loss": 1.0},
        "sync-fp32-h10": {"eval_loss": 1.1},
        "decoupled-int4-h10": {"eval_loss": 1.21},
    }
    assert gaps(runs) == {
        "sync-fp32-h10_vs_dp": 0.1,
        "decoupled-int4-h10_vs_dp": 0.21,
        "decoupled-int4-h10_vs_sync-fp32-h10": 0.1,
    }


def test_the_cpu_smoke_bench_trains_three_ways_and_its_exports_score_the_same(
    tmp_path: Path,
) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
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
            "--runs",
            json.dumps(["dp", "sync", "decoupled", "sanity"]),
            "--sanity-steps",
            "40",
            "--export-dir",
            str(tmp_path / "models"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert sorted(runs) == ["decoupled-int4-h10", "dp", "sync-fp32-h10"]
    assert len({r["tokens"] for r in runs.values()}) == 1  # equal tokens
    for one in runs.values():
        assert round(one["eval_loss_exported"], 3) == round(one["eval_loss"], 3)
    assert runs["decoupled-int4-h10"]["bandwidth_reduction"] > 1
    assert set(result["gaps"]) == {
        "sync-fp32-h10_vs_dp",
        "decoupled-int4-h10_vs_dp",
        "decoupled-int4-h10_vs_sync-fp32-h10",
    }
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
