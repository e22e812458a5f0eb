"""`atoll bench hetero`: one learner 4x slower, against all at full speed, same wall clock.

Two decoupled runs of M learners for the same wall-clock budget (the job ends at its step
budget in the homogeneous run; the heterogeneous run gets the same number of seconds): in
the second, one learner is artificially 4x slower (`--speeds 1,..,0.25`, standing in for an
older accelerator). Reported: the fast learners' tokens/s against their tokens/s in the
homogeneous run (token-weighted merging means the slow one never holds them up), and the
eval loss against the homogeneous run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pydantic import Field

from bench.options import Model, Output
from bench.runs import algorithm_flags, model_flags, up, write


class HeteroBench(Model, Output):
    """M learners with one 4x slower, against all at full speed, same wall clock."""

    batch_size: int = Field(16, ge=1, description="sequences per step per learner")
    learners: int = Field(4, ge=2, le=16, description="M")
    steps: int = Field(200, ge=20, description="inner steps per learner (homogeneous run)")
    slow_speed: float = Field(0.25, gt=0.0, lt=1.0, description="the slow learner's speed")
    inner_steps: int = Field(40, ge=1, description="H")
    fragments: int = Field(4, ge=1, description="P")
    codec: str = Field("int8", description="codec of outer gradients")
    seed: int = Field(0, description="initialization and data seed")

    def cli_cmd(self) -> None:
        run(self)


def _tokens_per_second(report: dict[str, Any], learners: list[str]) -> float:
    rates = []
    for p in report["per_learner"]:
        if p["learner"] in learners and p["tokens"]:
            rates.append(p["tokens"] / report["wall_seconds"])
    return sum(rates) / len(rates) if rates else 0.0


def run(settings: HeteroBench) -> None:
    m = settings.learners
    common = [
        *model_flags(settings),
        *algorithm_flags(settings),
        "--learners",
        str(m),
        "--threads",
        "1",
        "--batch-size",
        str(settings.batch_size),
        "--seed",
        str(settings.seed),
        "--eval-every",
        "0",
    ]
    fast = [f"learner-{i}" for i in range(m - 1)]
    with tempfile.TemporaryDirectory(prefix="atoll-hetero-") as tmp:
        root = Path(tmp)
        homogeneous = up(root / "homogeneous", [*common, "--steps", str(settings.steps)])
        # The same wall clock: the slow learner does a quarter of a fast one's steps, so the
        # job budget is what the four do in that time.
        budget = int(settings.steps * (m - 1 + settings.slow_speed))
        speeds = ",".join(["1"] * (m - 1) + [str(settings.slow_speed)])
        hetero = up(
            root / "hetero",
            [
                *common,
                "--steps",
                str(settings.steps),
                "--job-steps",
                str(budget),
                "--speeds",
                speeds,
            ],
        )
    homo_rate = _tokens_per_second(homogeneous, fast)
    hetero_rate = _tokens_per_second(hetero, fast)
    result = {
        "learners": m,
        "slow_speed": settings.slow_speed,
        "homogeneous": {
            "eval_loss": homogeneous["eval_loss"],
            "wall_seconds": homogeneous["wall_seconds"],
            "fast_tokens_per_s": round(homo_rate, 1),
        },
        "hetero": {
            "eval_loss": hetero["eval_loss"],
            "wall_seconds": hetero["wall_seconds"],
            "fast_tokens_per_s": round(hetero_rate, 1),
            "tokens_total": hetero["tokens_total"],
        },
        "fast_learner_speed_ratio": round(hetero_rate / homo_rate, 4) if homo_rate else 0.0,
        "loss_gap": round(
            (hetero["eval_loss"] - homogeneous["eval_loss"]) / homogeneous["eval_loss"], 4
        ),
    }
    write(result, settings.json_path)
