"""`atoll bench goodput`: one seeded fault schedule, replayed against decoupled and sync mode.

Three `atoll up` runs of the same model, learners and step budget: decoupled without faults
(the eval-loss reference), then decoupled and sync under the same `--chaos SPEC --seed N`.
The schedule is drawn from the seed alone, so both faulty runs get the same faults at the
same times (counted from their first inner step), on the same victims.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pydantic import Field

from bench.options import Model, Output
from bench.runs import algorithm_flags, eval_model_flags, up, write


class GoodputBench(Model, Output):
    """Goodput and eval loss of decoupled and sync mode under one seeded fault schedule."""

    batch_size: int = Field(16, ge=1, description="sequences per step per learner")
    learners: int = Field(4, ge=2, le=16, description="M")
    steps: int = Field(200, ge=20, description="inner steps per learner slot (the job's budget)")
    inner_steps: int = Field(40, ge=1, description="H (the job default)")
    fragments: int = Field(4, ge=1, description="P")
    codec: str = Field("int8", description="codec of outer gradients")
    chaos: str = Field(
        "learner-kill:mtbf=30s,down=30s",
        description="the fault SPEC both faulty runs get (a learner takes 30 s to come back, "
        "longer than a fragment's sync interval: on this scale, a node replaced in minutes "
        "at a sync interval of minutes)",
    )
    eval_batches: int = Field(16, ge=1, description="eval batches (x batch size sequences)")
    seed: int = Field(1, description="seed of the fault schedule, the model and the data")

    def cli_cmd(self) -> None:
        run(self)


def _figures(report: dict[str, Any]) -> dict[str, Any]:
    return {
        "goodput": report["goodput"],
        "eval_loss": report["eval_loss"],
        "wall_seconds": report["wall_seconds"],
        "tokens_total": report["tokens_total"],
        "versions_committed": report["versions_committed"],
        "faults_injected": report["faults"]["injected"],
        "invariants_ok": report["invariants"]["ok"],
        "badput_seconds": {
            source: round(sum(p["badput_seconds"][source] for p in report["per_learner"]), 3)
            for source in report["per_learner"][0]["badput_seconds"]
        },
    }


def run(settings: GoodputBench) -> None:
    common = [
        *eval_model_flags(settings),
        *algorithm_flags(settings),
        "--learners",
        str(settings.learners),
        "--steps",
        str(settings.steps),
        "--batch-size",
        str(settings.batch_size),
        "--threads",
        "1",
    ]
    chaos = ["--chaos", settings.chaos]
    with tempfile.TemporaryDirectory(prefix="atoll-goodput-") as tmp:
        root = Path(tmp)
        clean = up(root / "clean", [*common, "--mode", "decoupled"])
        decoupled = up(root / "decoupled", [*common, "--mode", "decoupled", *chaos])
        sync = up(root / "sync", [*common, "--mode", "sync", *chaos])
    result = {
        "learners": settings.learners,
        "steps": settings.steps,
        "chaos": settings.chaos,
        "seed": settings.seed,
        "decoupled": _figures(decoupled),
        "sync": _figures(sync),
        "decoupled_fault_free": _figures(clean),
        "faults": decoupled["faults"]["schedule"],
        "sync_faults": sync["faults"]["schedule"],
        "goodput_gain": round(decoupled["goodput"] - sync["goodput"], 4),
        "eval_loss_vs_fault_free": round(
            (decoupled["eval_loss"] - clean["eval_loss"]) / clean["eval_loss"], 4
        ),
    }
    write(result, settings.json_path)
