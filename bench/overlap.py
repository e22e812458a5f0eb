"""`atoll bench overlap`: a learner's steps/s with syncing on, against the same learner with
syncing off (`--standalone`), same model and machine, in one invocation.

Both learners get the same CPU threads; with syncing on, the synchronizer and Redis run on
this machine too, as in `atoll up`. Steps/s counts from the second step (the first compiles)
to the last, so start-up and the final sync are left out of both.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from pydantic import Field

from bench.options import Model, Output
from bench.runs import (
    algorithm_flags,
    atoll,
    learner_summaries,
    model_flags,
    steps_per_second,
    up,
    write,
)


class OverlapBench(Model, Output):
    """Learner steps/s with syncing on against syncing off (`--standalone`)."""

    batch_size: int = Field(16, ge=1, description="sequences per step (the learner default)")
    steps: int = Field(300, ge=20, description="inner steps of each run")
    inner_steps: int = Field(40, ge=1, description="H (the job default)")
    fragments: int = Field(4, ge=1, description="P")
    codec: str = Field("int8", description="codec of outer gradients")
    threads: int = Field(1, ge=1, description="CPU threads of the learner in both runs")

    def cli_cmd(self) -> None:
        run(self)


def run(settings: OverlapBench) -> None:
    model = [
        *model_flags(settings),
        "--batch-size",
        str(settings.batch_size),
        "--threads",
        str(settings.threads),
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--log-every",
        "1",
        "--steps",
        str(settings.steps),
    ]
    with tempfile.TemporaryDirectory(prefix="atoll-overlap-") as tmp:
        root = Path(tmp)
        (root / "alone" / "w").mkdir(parents=True)
        atoll(
            [
                "learner",
                *model,
                "--standalone",
                "--id",
                "alone",
                "--report",
                str(root / "alone" / "w" / "alone.1.summary.json"),
            ]
        )
        nosync = steps_per_second(learner_summaries(root / "alone")[0], skip=2)
        report = up(
            root / "synced",
            [
                *model,
                "--learners",
                "1",
                "--mode",
                "decoupled",
                *algorithm_flags(settings),
            ],
        )
        synced = steps_per_second(learner_summaries(root / "synced")[0], skip=2)
    write(
        {
            "steps": settings.steps,
            "syncs": report["versions_committed"],
            "steps_s_sync": round(synced, 4),
            "steps_s_nosync": round(nosync, 4),
            "overhead": round(1.0 - synced / nosync, 4),
        },
        settings.json_path,
    )
