"""`atoll bench wan`: a race across regions on this machine, over links the kernel shapes.

Every run is `atoll up --regions` (root: network namespaces, veth pairs capped by tbf): the
same regions, the same model, the same text in the same order (`--data-split windows`, so
the learners' batches at step k together hold data-parallel's batch k), the same tokens.

- dp: data-parallel over the same links (`--data-parallel`): one learner of one process per
  region slot, gradients reduced every step across the links. By default each process holds
  the whole model and the step all-reduces the gradients (`--dp-param-layout replicated`):
  about one model size (fp32) each way per step over each link of two regions, what
  classic data-parallel moves; `sharded` runs it fully sharded (FSDP) instead, parameters
  gathered for the forward and backward passes and gradients reduce-scattered, which moved
  1.8x (a 119k-parameter model) to 3.6x (6.1M) the model's size each way per step;
- decoupled: Decoupled DiLoCo, each region's learners never waiting on the links;
- sync: classic DiLoCo, every learner waiting at each fragment's sync;
- uncapped: decoupled again with the links at 100 Gbit/s: what the cap costs a learner.

From each run: wall seconds, tokens/s per learner, the global model's eval loss over wall
time, the bytes over each region's link and the share of its capacity they used (the
kernel's counters). Then `time_to_dp_loss_s`: when a run's global model first reached
data-parallel's final eval loss, or came within `--tolerance` of it (null: never); and
`throughput_kept`: a decoupled learner's steps/s with the links capped over the same
learner's uncapped. dp's entry also says the `param_layout` its learner ran with.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from bench.options import Model, Output
from bench.runs import algorithm_flags, learner_summaries, model_flags, steps_per_second, up, write
from learner.settings import ParamLayout


class WanBench(Model, Output):
    """A race across regions on this machine (root): data-parallel, decoupled and sync
    DiLoCo over the same shaped links, and decoupled uncapped for `throughput_kept`."""

    regions: str = Field("us:1,eu:1", description="the regions, as atoll up --regions")
    rate: str = Field("100mbit", description="each region link's rate cap (atoll up --link)")
    delay: str = Field("", description="each link's one-way delay, e.g. 40ms (atoll's proxy)")
    steps: int = Field(200, ge=10, description="inner steps per learner slot (same tokens)")
    inner_steps: int = Field(50, ge=1, description="H of the decoupled and sync runs")
    fragments: int = Field(4, ge=1, description="P")
    codec: str = Field("int8", description="codec of outer gradients")
    eval_every: int = Field(20, ge=1, description="steps between evaluations of the global model")
    eval_batches: int = Field(4, ge=1, description="eval batches (x batch size sequences)")
    threads: int = Field(1, ge=1, description="CPU threads of each learner process")
    dp_lr: float | None = Field(
        None,
        gt=0.0,
        description="dp's inner peak learning rate (default: the learner's, as decoupled and "
        "sync use): dp takes one step per M learners' batches, so sweep it to tune the "
        "reference",
    )
    lr: float | None = Field(
        None,
        gt=0.0,
        description="the decoupled, sync and uncapped learners' inner peak learning rate "
        "(default: the learner's), to tune them as --dp-lr tunes dp",
    )
    outer_lr: float | None = Field(
        None,
        gt=0.0,
        description="the decoupled, sync and uncapped runs' outer learning rate (default: "
        "the job's)",
    )
    downlink_codec: str | None = Field(
        None,
        description="codec of the new global values the decoupled, sync and uncapped runs "
        "send back to learners (default: the job's, int8)",
    )
    clip_norm: float | None = Field(
        None,
        ge=0.0,
        description="every run's inner gradient clipping (atoll learner --clip-norm; default: "
        "the learner's)",
    )
    dp_param_layout: ParamLayout = Field(
        "replicated",
        description="how dp's processes hold the model (atoll learner --param-layout). "
        "replicated: each the whole model, gradients all-reduced every step, about 1x the "
        "model's fp32 size each way per step over each link of two regions (classic "
        "data-parallel); sharded: split over the processes (FSDP), parameters gathered for "
        "the forward and backward passes and gradients reduce-scattered, 1.8x to 3.6x",
    )
    seed: int = Field(1, description="initialization and data seed")
    tolerance: float = Field(
        0.01, ge=0.0, description="time_to_dp_loss_s counts a loss within this share of dp's"
    )
    runs: list[str] = Field(
        ["dp", "decoupled", "sync", "uncapped"],
        description="which runs, of dp, decoupled, sync and uncapped",
    )
    timeout_s: float = Field(3600.0, gt=0.0, description="each run's limit (atoll up)")
    plot: Path | None = Field(None, description="write a PNG of eval loss against wall time")

    def cli_cmd(self) -> None:
        run(self)


UNCAPPED = "rate=100gbit"
RUNS = ("dp", "decoupled", "sync", "uncapped")


def eval_curve(summaries: Sequence[dict[str, Any]], started_at: float) -> list[list[float]]:
    """The global model's eval loss over the run's wall time: every learner's evaluations
    (they take turns on the same global model), as [seconds since the run started, loss]."""
    points = sorted(
        (float(s["started_at"]) + float(t) - started_at, float(loss))
        for s in summaries
        for t, _step, _tokens, loss in s.get("evals", [])
    )
    return [[round(t, 3), round(loss, 5)] for t, loss in points]


def time_to_loss(curve: Sequence[Sequence[float]], target: float, tolerance: float) -> float | None:
    """When the curve first reached `target`, or came within `tolerance` (relative) of it."""
    for t, loss in curve:
        if loss <= target * (1.0 + tolerance):
            return float(t)
    return None


def throughput_kept(capped: float, uncapped: float) -> float | None:
    return round(capped / uncapped, 4) if uncapped > 0 else None


def summarize(report: dict[str, Any], summaries: list[dict[str, Any]]) -> dict[str, Any]:
    learners = [s for s in summaries if s.get("losses")]
    rates = [steps_per_second(s, skip=2) for s in learners]
    return {
        "wall_seconds": round(float(report["wall_seconds"]), 3),
        "final_eval_loss": report["eval_loss"],
        "tokens": sum(int(s["tokens"]) for s in learners),
        "tokens_per_s_per_learner": round(
            sum(int(s["tokens"]) / float(s["wall_seconds"]) for s in learners) / len(learners),
            1,
        ),
        "steps_per_s_per_learner": round(sum(rates) / len(rates), 4),
        "eval_curve": eval_curve(learners, float(report["started_at"])),
        "links": {k: v for k, v in report["regions"].items() if k != "link"},
    }


def common_flags(settings: WanBench) -> list[str]:
    return [
        *model_flags(settings),
        "--regions", settings.regions,
        "--batch-size", str(settings.batch_size),
        "--steps", str(settings.steps),
        "--data-split", "windows",
        "--seed", str(settings.seed),
        "--eval-every", str(settings.eval_every),
        "--eval-batches", str(settings.eval_batches),
        "--log-every", "1",
        "--threads", str(settings.threads),
        "--timeout-s", str(settings.timeout_s),
        *(["--clip-norm", str(settings.clip_norm)] if settings.clip_norm is not None else []),
    ]  # fmt: skip


def planned(settings: WanBench) -> list[tuple[str, list[str]]]:
    link = f"rate={settings.rate}" + (f",delay={settings.delay}" if settings.delay else "")
    # The learning rates of the DiLoCo runs (dp's is its own, --dp-lr).
    tuning = ["--lr", str(settings.lr)] if settings.lr is not None else []
    if settings.outer_lr is not None:
        tuning += ["--outer-lr", str(settings.outer_lr)]
    if settings.downlink_codec is not None:
        tuning += ["--downlink-codec", settings.downlink_codec]
    decoupled = ["--mode", "decoupled", "--no-shared-budget", *algorithm_flags(settings), *tuning]
    plans = {
        "dp": [
            "--link",
            link,
            "--data-parallel",
            "--param-layout",
            settings.dp_param_layout,
            *(["--lr", str(settings.dp_lr)] if settings.dp_lr is not None else []),
        ],
        "decoupled": ["--link", link, *decoupled],
        "sync": ["--link", link, "--mode", "sync", *algorithm_flags(settings), *tuning],
        "uncapped": ["--link", UNCAPPED, *decoupled],
    }
    return [(name, plans[name]) for name in RUNS if name in settings.runs]


def result(settings: WanBench, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "settings": settings.model_dump(mode="json", by_alias=True),
        "runs": runs,
    }
    if "dp" in runs:
        target = runs["dp"]["final_eval_loss"]
        out["dp_final_eval_loss"] = target
        for name in ("decoupled", "sync"):
            if name in runs:
                reached = time_to_loss(runs[name]["eval_curve"], target, settings.tolerance)
                runs[name]["time_to_dp_loss_s"] = reached
                runs[name]["time_to_dp_loss_of_dp_wall"] = (
                    round(reached / runs["dp"]["wall_seconds"], 4) if reached is not None else None
                )
    if "decoupled" in runs and "uncapped" in runs:
        out["throughput_kept"] = throughput_kept(
            runs["decoupled"]["steps_per_s_per_learner"],
            runs["uncapped"]["steps_per_s_per_learner"],
        )
    return out


def run(settings: WanBench) -> None:
    unknown = sorted(set(settings.runs) - set(RUNS))
    if unknown:
        raise SystemExit(f"atoll bench wan: --runs {unknown}: choose from {', '.join(RUNS)}")
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="atoll-wan-") as tmp:
        root = Path(tmp)
        for name, flags in planned(settings):
            report = up(root / name, [*common_flags(settings), *flags])
            summaries = learner_summaries(root / name)
            runs[name] = summarize(report, summaries)
            if name == "dp":  # as the learner says it ran, not as asked
                runs[name]["param_layout"] = summaries[0].get("param_layout")
            write(result(settings, runs), settings.json_path)
    final = result(settings, runs)
    if settings.plot is not None:
        plot_race(final, settings.plot)


def plot_race(race: dict[str, Any], path: Path) -> None:
    """Eval loss against wall time, one line per run, data-parallel's final loss dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, data in race["runs"].items():
        if data["eval_curve"]:
            t, loss = zip(*data["eval_curve"], strict=True)
            ax.plot(t, loss, marker=".", label=f"{name} ({data['wall_seconds']:.0f} s)")
    if race.get("dp_final_eval_loss") is not None:
        ax.axhline(race["dp_final_eval_loss"], linestyle="--", color="gray", label="dp final")
    link = race["settings"]["rate"]
    ax.set(xlabel="wall seconds", ylabel="eval loss (nats per byte)", title=f"links at {link}")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
