"""`atoll up --export`, `atoll export` and `atoll eval` on a real short run: the exported model
scores the run's own eval loss on the run's evaluation text."""

from __future__ import annotations

import json
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from cluster.export import ExportError, builtin_config
from cluster.processes import atoll_command
from cluster.redis_server import RedisServer
from services.layout import LeafSpec
from tests.test_up import up


def atoll(*args: str) -> dict[str, object]:
    proc = subprocess.run(atoll_command(*args), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(json.loads(proc.stdout[proc.stdout.index("{") :]))


def test_an_exported_model_scores_the_runs_eval_loss(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    eval_data = Path(sysconfig.get_paths()["stdlib"]) / "json"  # never trained on
    model_file = tmp_path / "model.safetensors"
    report = up(
        tmp_path,
        "--redis-url",
        redis_server.url,
        "--job",
        "exported",
        "--learners",
        "2",
        "--steps",
        "30",
        "--inner-steps",
        "10",
        "--fragments",
        "2",
        "--eval-data",
        json.dumps([str(eval_data)]),
        "--eval-windows",
        "24",
        "--export",
        str(model_file),
    )
    assert report["invariants"]["ok"], report["invariants"]  # type: ignore[index]

    # `atoll export` of the finished job (its Redis outlives the run) writes the same model.
    again = tmp_path / "again.safetensors"
    meta = atoll(
        "export",
        "--redis-url",
        redis_server.url,
        "--tensor-store",
        str(tmp_path / "w" / "tensors"),
        "--job",
        "exported",
        "--heads",
        "4",
        "--out",
        str(again),
    )
    first, second = load_file(model_file), load_file(again)
    assert sorted(first) == sorted(second)
    for name, value in first.items():
        np.testing.assert_array_equal(value, second[name])
    config = json.loads(str(meta["model_config"]))
    assert config == {
        "model": "builtin",
        "layers": 2,
        "width": 64,
        "heads": 4,
        "context": 64,
        "dtype": "auto",
    }
    assert json.loads(str(meta["versions"])) == [
        max(e["version"] for e in report["commits"] if e["fragment"] == p)  # type: ignore[union-attr,attr-defined]
        for p in range(2)
    ]

    scored = atoll(
        "eval",
        "--model-file",
        str(model_file),
        "--data",
        str(eval_data),
        "--windows",
        "24",
        "--batch-size",
        "5",  # batching does not change the loss
        "--json",
        str(tmp_path / "eval.json"),
    )
    assert scored["tokens"] == 24 * 64
    assert json.loads((tmp_path / "eval.json").read_text()) == scored
    run_loss = float(report["eval_loss"])  # type: ignore[arg-type]
    assert round(float(scored["eval_loss"]), 3) == round(run_loss, 3)  # type: ignore[arg-type]
    assert abs(float(scored["eval_loss"]) - run_loss) < 1e-5  # type: ignore[arg-type]
    # Deterministic run to run.
    score = ["eval", "--model-file", str(model_file), "--data", str(eval_data)]
    assert atoll(*score)["eval_loss"] == atoll(*score)["eval_loss"]


def test_the_model_config_is_read_from_the_spec_and_heads_must_be_given() -> None:
    d, t = 8, 16
    specs = [LeafSpec("embed", (256, d)), LeafSpec("pos", (t, d)), LeafSpec("ln_f/scale", (d,))]
    for i in range(3):
        specs += [
            LeafSpec(f"blocks/{i}/ln1/scale", (d,)),
            LeafSpec(f"blocks/{i}/attn/qkv", (d, 3 * d)),
            LeafSpec(f"blocks/{i}/attn/out", (d, d)),
            LeafSpec(f"blocks/{i}/ln2/scale", (d,)),
            LeafSpec(f"blocks/{i}/mlp/in", (d, 4 * d)),
            LeafSpec(f"blocks/{i}/mlp/out", (4 * d, d)),
        ]
    assert builtin_config(specs, 2, "bfloat16") == {
        "model": "builtin",
        "layers": 3,
        "width": d,
        "heads": 2,
        "context": t,
        "dtype": "bfloat16",
    }
    with pytest.raises(ExportError, match="--heads"):
        builtin_config(specs, None, "auto")
    with pytest.raises(ExportError, match="does not divide"):
        builtin_config(specs, 3, "auto")
    with pytest.raises(ExportError, match="add up"):
        builtin_config(specs[:-1], 2, "auto")
    assert builtin_config([LeafSpec("w", (3,))], None, "auto", "mine:model") == {
        "model": "mine:model"
    }
