"""`atoll bench byzantine`: what one hostile learner of M, or a colluding pair, does to the
model, against the all-honest run of the same seeds.

Every run is the CPU quality bench's (`atoll bench quality`'s defaults: its model, M=4
learners on one token stream, its H, P and codec; sync, or decoupled with `--mode
decoupled`), through `atoll up` with the job's defences as shipped (the default quorum,
clipping to a multiple of the median norm of recent accepted updates, the warm-up bound, the
direction, shrink and size drops). A hostile learner (`atoll up --hostile`,
`learner/hostile.py`) trains as usual and sends a corrupted update every round it can:

- one of M for each `--variants` kind (sign-flip, x100, random, replace);
- a colluding pair (two of M) of the `--colluding` kind;
- M-1 honest learners and no hostile one (`honest-fewer`): a hostile slot's share of the text
  is lost whatever the defence. For comparison, not a floor: runs this short move with which
  learners' text they see (docs/security.md).

Each row runs once per seed; the result gives each row's final eval loss (mean, min, max,
spread) and its gap to the honest row's mean, its bytes and goodput. The issue's bar: within
2% of the honest run for one hostile learner of four, within 5% and finite for a pair.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from statistics import mean
from typing import Any, Literal

from pydantic import Field, field_validator

from bench.options import Model, Output
from bench.quality import (
    QualityBench,
    common_flags,
    learner_flags,
    spread_of,
    steps_of,
    summarize,
)
from bench.runs import up, write
from learner.hostile import HOSTILITIES, Hostility

HONEST = "honest"
FEWER = "honest-fewer"  # M-1 honest learners, no hostile one: a reference, not an attack
ONE_OF_M_BOUND = 0.02  # the bar: one hostile learner of four
PAIR_BOUND = 0.05  # a colluding pair of four


class ByzantineBench(Model, Output):
    """The final eval loss with one hostile learner of M (each --variants kind) and with a
    colluding pair, against the all-honest run of the same seeds."""

    learners: int = Field(4, ge=3, le=16, description="M (a pair of colluders needs 3 or more)")
    steps: int = Field(150, ge=1, description="inner steps per learner")
    inner_steps: int = Field(12, ge=1, description="H")
    fragments: int = Field(3, ge=1, description="P")
    codec: str = Field("int8", description="codec of the updates, both directions")
    mode: Literal["decoupled", "sync"] = Field(
        "sync",
        description="the learners' mode: sync (every round waits for every live learner: a "
        "row differs from the honest one by what the hostile slots do, not by timing) or "
        "decoupled (rounds merge whoever has sent, so which updates meet depends on timing, "
        "and runs of one seed differ by a few percent: more seeds to see a gap of 2 percent)",
    )
    variants: list[Hostility] = Field(
        list(HOSTILITIES), description="the kinds of one hostile learner, one row each"
    )
    colluding: Hostility | None = Field(
        "replace", description="the kind of the colluding pair's row; none: no such row"
    )

    @field_validator("colluding", mode="before")
    @classmethod
    def _none(cls, value: object) -> object:
        return None if value in ("none", "") else value

    fewer: bool = Field(
        True,
        description="also run M-1 honest learners and no hostile one (row honest-fewer), "
        "for comparison: a hostile slot's share of the text is lost whatever the defence",
    )
    seeds: list[int] = Field(
        [0, 1], min_length=1, description="seeds: every row runs once per seed"
    )
    threads: int = Field(1, ge=1, description="CPU threads of each learner")
    data: list[Path] = Field(
        default_factory=list, description="training text; empty: this Python's standard library"
    )
    eval_windows: int = Field(128, ge=1, description="windows every run is scored on")

    def cli_cmd(self) -> None:
        run(self)


def quality_settings(settings: ByzantineBench) -> QualityBench:
    """The quality bench's settings these runs share with it (model, text, schedule)."""
    return QualityBench(
        layers=settings.layers,
        width=settings.width,
        heads=settings.heads,
        context=settings.context,
        batch_size=settings.batch_size,
        learners=settings.learners,
        steps=settings.steps,
        inner_steps=[settings.inner_steps],
        fragments=settings.fragments,
        threads=settings.threads,
        data=settings.data,
        eval_windows=settings.eval_windows,
    )


def planned(settings: ByzantineBench) -> list[tuple[str, dict[str, str], int]]:
    """(row, hostile slots, learners) of every row: the honest one first."""
    m = settings.learners
    last = f"learner-{m - 1}"
    rows: list[tuple[str, dict[str, str], int]] = [(HONEST, {}, m)]
    if settings.fewer:
        rows.append((FEWER, {}, m - 1))
    rows += [(f"one-{kind}", {last: kind}, m) for kind in settings.variants]
    if settings.colluding is not None:
        kind: str = settings.colluding
        pair = {f"learner-{m - 2}": kind, last: kind}
        rows.append((f"pair-{settings.colluding}", pair, m))
    return rows


def flags(settings: ByzantineBench, seed: int, hostile: dict[str, str], learners: int) -> list[str]:
    quality = quality_settings(settings)
    return [
        *common_flags(quality, seed),
        *learner_flags(quality, learners, steps_of(quality)),
        "--inner-steps",
        str(settings.inner_steps),
        "--mode",
        settings.mode,
        "--no-shared-budget",  # each learner exactly --steps: equal tokens in every run
        "--codec",
        settings.codec,
        "--downlink-codec",
        settings.codec,
        *(["--hostile", json.dumps(hostile)] if hostile else []),
    ]


def _per_learner(report: dict[str, Any], key: str) -> dict[str, list[float]]:
    """Every merged update's `key` entry (as report commits carry them), per learner."""
    out: dict[str, list[float]] = {}
    for commit in report["commits"]:
        values = commit.get(key) or []
        for who, value in zip(commit.get("learners") or [], values, strict=False):
            if value is not None:
                out.setdefault(who, []).append(float(value))
    return out


def clipped(report: dict[str, Any]) -> dict[str, int]:
    """Per learner, how many of its merged updates were clipped (scaled down to the bound)."""
    clips = _per_learner(report, "clips")
    return {who: n for who, c in clips.items() if (n := sum(0.0 < x < 1.0 for x in c))}


def dropped(report: dict[str, Any]) -> dict[str, int]:
    """Per learner, how many of its updates merged at no weight (clip 0: pointing against
    the fragment's last merged outer gradient, shrinking or growing the fragment's values,
    or far larger than the other slots' updates)."""
    clips = _per_learner(report, "clips")
    return {who: n for who, c in clips.items() if (n := sum(x == 0.0 for x in c))}


def signs(report: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Per learner, the least, median and greatest agreement of its checked updates with the
    fragment's last merged outer gradient (`agreement`) and with the fragment's own values
    (`shrink`): where honest updates sit against the checks' bounds."""
    out: dict[str, dict[str, list[float]]] = {}
    for key, name in (("agreements", "agreement"), ("shrinks", "shrink")):
        for who, values in _per_learner(report, key).items():
            ordered = sorted(values)
            middle = ordered[len(ordered) // 2]
            out.setdefault(who, {})[name] = [round(x, 4) for x in (ordered[0], middle, ordered[-1])]
    return out


def result(settings: ByzantineBench, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rows over their seeds, each against the honest row: the gap of the means, and
    whether it is within the issue's bound (2% for one of M, 5% and finite for a pair)."""
    table: dict[str, dict[str, Any]] = {}
    for row, _, _ in planned(settings):
        mine = [r for r in runs.values() if r["row"] == row]
        if not mine:
            continue
        losses = [float(r["eval_loss"]) for r in mine]
        table[row] = {
            "seeds": [r["seed"] for r in mine],
            "eval_loss": spread_of(losses),
            "finite": all(math.isfinite(x) for x in losses),
            "goodput": round(mean(float(r["goodput"]) for r in mine), 4),
            "bytes": round(mean(float(r["bytes"]) for r in mine)),
            "dropped": {
                who: sum(r["dropped"].get(who, 0) for r in mine)
                for who in sorted({w for r in mine for w in r["dropped"]})
            },
            "clipped": {
                who: sum(r["clipped"].get(who, 0) for r in mine)
                for who in sorted({w for r in mine for w in r["clipped"]})
            },
        }
    honest = table.get(HONEST)
    if honest is not None:
        base = honest["eval_loss"]["mean"]
        for row, entry in table.items():
            if row == HONEST:
                continue
            gap = (entry["eval_loss"]["mean"] - base) / base
            entry["gap_vs_honest"] = round(gap, 4)
            if row == FEWER:  # a reference, not an attack: no bound
                continue
            bound = PAIR_BOUND if row.startswith("pair-") else ONE_OF_M_BOUND
            entry["within_bound"] = bool(entry["finite"] and gap <= bound)
            entry["bound"] = bound
    return {
        "bench": "byzantine",
        "learners": settings.learners,
        "steps": settings.steps,
        "inner_steps": settings.inner_steps,
        "fragments": settings.fragments,
        "codec": settings.codec,
        "mode": settings.mode,
        "seeds": settings.seeds,
        "rows": table,
        "runs": runs,
        "all_within_bound": all(
            e.get("within_bound", True) for r, e in table.items() if r not in (HONEST, FEWER)
        ),
    }


def run(settings: ByzantineBench) -> None:
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="atoll-byzantine-") as tmp:
        for seed in settings.seeds:
            for row, hostile, learners in planned(settings):
                name = f"{row}/seed{seed}"
                workdir = Path(tmp) / row / f"seed{seed}"
                report = up(workdir, flags(settings, seed, hostile, learners))
                runs[name] = {
                    **summarize(report),
                    "eval_loss": report["eval_loss"],
                    "row": row,
                    "seed": seed,
                    "hostile": hostile,
                    "clipped": clipped(report),
                    "dropped": dropped(report),
                    "signs": signs(report),
                }
                print(f"{name}: eval loss {report['eval_loss']:.4f}", flush=True)
                write(result(settings, runs), settings.json_path)
    out = result(settings, runs)
    write(out, settings.json_path)
    print(json.dumps(out["rows"], indent=2))
