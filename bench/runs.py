"""Benchmarks run the system as users do: `atoll up` and `atoll learner` as subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster.report import read_summaries
from cluster.settings import IDENTITY_DEFENCES_OFF


def atoll(args: Sequence[str], timeout_s: float = 3600) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "atoll.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"atoll {' '.join(args[:1])} failed ({proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )


def up(workdir: Path, args: Sequence[str]) -> dict[str, Any]:
    """Run `atoll up` with `args`; return its report."""
    report = workdir / "report.json"
    atoll(["up", "--workdir", str(workdir / "w"), "--report", str(report), "--no-live", *args])
    return dict(json.loads(report.read_text()))


# Merges that change nothing: float32 both ways, one outer step of lr 1 without momentum,
# and none of the defences against hostile slots that drop or clip an update (a learner
# alone on its fragment is clipped to the warm-up RMS; cluster/settings.py).
IDENTITY_MERGE = (
    "--codec",
    "fp32",
    "--downlink-codec",
    "fp32",
    "--outer-lr",
    "1.0",
    "--outer-momentum",
    "0",
    *(f"--{name.replace('_', '-')}={value}" for name, value in IDENTITY_DEFENCES_OFF.items()),
)


def model_flags(settings: Any) -> list[str]:
    """The built-in model's flags from a benchmark's settings."""
    return [
        "--layers",
        str(settings.layers),
        "--width",
        str(settings.width),
        "--heads",
        str(settings.heads),
        "--context",
        str(settings.context),
    ]


def eval_model_flags(settings: Any) -> list[str]:
    """The model's flags, evaluated once at the end on `eval_batches` batches, seeded."""
    return [
        *model_flags(settings),
        "--eval-batches",
        str(settings.eval_batches),
        "--eval-every",
        "0",
        "--seed",
        str(settings.seed),
    ]


def data_parallel(
    workdir: Path,
    model: Sequence[str],
    learners: int,
    steps: int,
    batch: int,
    threads: int = 2,
) -> dict[str, Any]:
    """Data-parallel training of `learners` learners, run as the exactly equivalent single
    learner with `learners` times the batch (one outer step of lr 1 without momentum and a
    float32 round trip is the identity). Returns its report."""
    return up(
        workdir,
        [
            *model,
            "--learners",
            "1",
            "--threads",
            str(threads),
            "--steps",
            str(steps),
            "--batch-size",
            str(learners * batch),
            "--mode",
            "sync",
            "--inner-steps",
            str(steps),
            "--fragments",
            "1",
            *IDENTITY_MERGE,
        ],
    )


def learner_flags(learners: int, steps: int, batch_size: int) -> list[str]:
    """M learners of one XLA thread each, `steps` inner steps per slot, `batch_size`."""
    return [
        "--learners",
        str(learners),
        "--steps",
        str(steps),
        "--threads",
        "1",
        "--batch-size",
        str(batch_size),
    ]


def algorithm_flags(settings: Any) -> list[str]:
    """H, P and the codec from a benchmark's settings."""
    return [
        "--inner-steps",
        str(settings.inner_steps),
        "--fragments",
        str(settings.fragments),
        "--codec",
        settings.codec,
    ]


def learner_summaries(workdir: Path) -> list[dict[str, Any]]:
    """Every learner slot's summary, its incarnations combined."""
    return read_summaries(workdir / "w")


def steps_per_second(summary: dict[str, Any], skip: int = 1) -> float:
    """Steps per second between step `skip` and the last step (the first step compiles)."""
    points = [(t, step) for t, step, _, _ in summary["losses"] if step >= skip]
    (t0, s0), (t1, s1) = points[0], points[-1]
    return float(s1 - s0) / float(t1 - t0)


def write(result: dict[str, Any], path: Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
