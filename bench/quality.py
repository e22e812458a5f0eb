"""`atoll bench quality`: one model, the same tokens, three ways, in one invocation.

- dp: data-parallel training of M learners, run as the mathematically equivalent single
  learner with M times the batch (one outer step of lr 1 without momentum is the identity);
  its bytes are what a ring all-reduce of fp32 gradients would send for M learners.
- sync: classic DiLoCo, M learners, every learner waits at each fragment sync.
- decoupled: Decoupled DiLoCo, M learners that never wait.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.runs import (
    algorithm_flags,
    data_parallel,
    eval_model_flags,
    learner_flags,
    up,
    write,
)
from services.bandwidth import dp_equivalent_bytes

if TYPE_CHECKING:
    from bench.settings import QualityBench


def run(settings: QualityBench) -> None:
    m, steps = settings.learners, settings.steps
    model = eval_model_flags(settings)
    algorithm = algorithm_flags(settings)
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="atoll-quality-") as tmp:
        root = Path(tmp)
        dp = data_parallel(root / "dp", model, m, steps, settings.batch_size)
        runs["dp"] = {
            "eval_loss": dp["eval_loss"],
            "bytes": int(dp_equivalent_bytes(dp["parameters"], m, m * steps)),
            "tokens": dp["tokens_total"],
        }
        for mode in ("sync", "decoupled"):
            report = up(
                root / mode,
                [
                    *model,
                    *algorithm,
                    *learner_flags(m, steps, settings.batch_size),
                    "--mode",
                    mode,
                ],
            )
            runs[mode] = {
                "eval_loss": report["eval_loss"],
                "bytes": report["bytes"]["up"] + report["bytes"]["down"],
                "tokens": report["tokens_total"],
                "goodput": report["goodput"],
                "wall_seconds": report["wall_seconds"],
            }
    dp_loss = runs["dp"]["eval_loss"]
    result = {
        "learners": m,
        "steps": steps,
        "runs": runs,
        "sync_vs_dp_loss_gap": round((runs["sync"]["eval_loss"] - dp_loss) / dp_loss, 4),
        "decoupled_vs_dp_loss_gap": round((runs["decoupled"]["eval_loss"] - dp_loss) / dp_loss, 4),
    }
    write(result, settings.json_path)
