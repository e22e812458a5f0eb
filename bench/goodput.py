"""`atoll bench goodput`: one seeded fault schedule, replayed against decoupled and sync mode.

Three `atoll up` runs of the same model, learners and step budget: decoupled without faults
(the eval-loss reference), then decoupled and sync under the same `--chaos SPEC --seed N`.
The schedule is drawn from the seed alone, so both faulty runs get the same faults at the
same times (counted from their first inner step), on the same victims.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.runs import algorithm_flags, eval_model_flags, up, write

if TYPE_CHECKING:
    from bench.settings import GoodputBench


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
