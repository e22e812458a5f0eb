"""`atoll bench bandwidth`: bytes on the wire against data-parallel, at equal tokens.

One invocation, one model, the same tokens for every run: a data-parallel baseline (the
exactly equivalent single learner with M times the batch; its bytes are a ring all-reduce of
fp32 gradients), then decoupled runs sweeping the codec (both directions) and H. For each
run: bytes up and down per learner-step as the services counted them, the reduction against
data-parallel, and the eval-loss gap against data-parallel. `best` is the largest reduction
whose loss gap is at most 2%.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pydantic import Field

from bench.options import Model, Output
from bench.runs import data_parallel, eval_model_flags, learner_flags, up, write
from services.bandwidth import dp_equivalent_bytes


class BandwidthBench(Model, Output):
    """Bytes against data-parallel at equal tokens, sweeping the codec and H."""

    learners: int = Field(4, ge=2, le=16, description="M")
    steps: int = Field(300, ge=10, description="inner steps per learner slot")
    fragments: int = Field(4, ge=1, description="P")
    quorum: int = Field(4, ge=1, description="K (rounds of several learners: fewer versions down)")
    inner_steps: list[int] = Field([30, 100], description="H values")
    codecs: list[str] = Field(
        ["fp32", "bf16", "int8", "int4"], description="codecs swept (both directions)"
    )
    eval_batches: int = Field(16, ge=1, description="eval batches (x batch size sequences)")
    seed: int = Field(0, description="initialization and data seed")
    outer_lr: float = Field(0.7, gt=0.0, description="outer learning rate of the decoupled runs")
    outer_momentum: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="outer Nesterov momentum of the decoupled runs (DiLoCo's 0.9 suits "
        "full rounds at large H)",
    )

    def cli_cmd(self) -> None:
        run(self)


LOSS_GAP_LIMIT = 0.02


def run(settings: BandwidthBench) -> None:
    m, steps = settings.learners, settings.steps
    model = eval_model_flags(settings)
    with tempfile.TemporaryDirectory(prefix="atoll-bandwidth-") as tmp:
        root = Path(tmp)
        dp = data_parallel(root / "dp", model, m, steps, settings.batch_size)
        learner_steps = m * steps
        dp_bytes = dp_equivalent_bytes(dp["parameters"], m, learner_steps)
        baseline = {
            "eval_loss": dp["eval_loss"],
            "bytes_per_learner_step": dp_bytes / learner_steps,
            "parameters": dp["parameters"],
        }
        runs: list[dict[str, Any]] = []
        for h in settings.inner_steps:
            for codec in settings.codecs:
                report = up(
                    root / f"{codec}-h{h}",
                    [
                        *model,
                        *learner_flags(m, steps, settings.batch_size),
                        "--inner-steps",
                        str(h),
                        "--fragments",
                        str(settings.fragments),
                        "--codec",
                        codec,
                        "--downlink-codec",
                        codec,
                        "--quorum",
                        str(settings.quorum),
                        "--outer-lr",
                        str(settings.outer_lr),
                        "--outer-momentum",
                        str(settings.outer_momentum),
                    ],
                )
                done = max(1, sum(p["steps"] for p in report["per_learner"]))
                up_bytes, down_bytes = report["bytes"]["up"], report["bytes"]["down"]
                runs.append(
                    {
                        "codec": codec,
                        "inner_steps": h,
                        "bytes_up_per_learner_step": round(up_bytes / done, 1),
                        "bytes_down_per_learner_step": round(down_bytes / done, 1),
                        "bandwidth_reduction": round(
                            dp_equivalent_bytes(dp["parameters"], m, done)
                            / (up_bytes + down_bytes),
                            1,
                        ),
                        "eval_loss": report["eval_loss"],
                        "loss_gap": round(
                            (report["eval_loss"] - dp["eval_loss"]) / dp["eval_loss"], 4
                        ),
                        "versions_committed": report["versions_committed"],
                    }
                )
    good = [r for r in runs if r["loss_gap"] <= LOSS_GAP_LIMIT]
    best = max(good, key=lambda r: r["bandwidth_reduction"]) if good else None
    write(
        {
            "learners": m,
            "steps": steps,
            "quorum": settings.quorum,
            "outer_lr": settings.outer_lr,
            "outer_momentum": settings.outer_momentum,
            "baseline": baseline,
            "runs": runs,
            "best": best,
        },
        settings.json_path,
    )
