"""`atoll bench quality`: one model, the same tokens, three ways, in one invocation.

- dp: data-parallel training of M learners, run as the mathematically equivalent single
  learner with M times the batch (one outer step of lr 1 without momentum is the identity),
  spread over every local device (the inner loop shards its batch over them); its bytes are
  what a ring all-reduce of fp32 gradients would send for M learners.
- sync: classic DiLoCo in fp32 both ways, M learners, every learner waits at each fragment
  sync; one run per H.
- decoupled: Decoupled DiLoCo, M learners that never wait; one run per codec and H.
- sanity: one learner through the decoupled path with fp32 both ways, outer lr 1 and no
  momentum (each merge is then the identity), against the same learner alone (one sync at
  its end): their training losses must agree step by step, to float noise.

Every run trains on the same text for the same tokens and is scored on the same evaluation
windows. The result is written after each run, so a long bench split over several
invocations (`--runs`, `--baseline`) or cut short keeps what it measured.
"""

from __future__ import annotations

import json
import math
import sysconfig
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.runs import (
    IDENTITY_MERGE,
    atoll,
    data_parallel,
    learner_summaries,
    model_flags,
    up,
    write,
)
from services.bandwidth import dp_equivalent_bytes

if TYPE_CHECKING:
    from bench.settings import QualityBench


def steps_of(settings: QualityBench) -> int:
    """Inner steps per learner: --steps, or --tokens over M learners' batches."""
    if not settings.tokens:
        return settings.steps
    per_step = settings.learners * settings.batch_size * settings.context
    return math.ceil(settings.tokens / per_step)


def data_paths(settings: QualityBench) -> list[Path]:
    """--data; the gpu preset's default adds the installed packages' sources to the
    standard library (hundreds of MB of text)."""
    if settings.data or settings.scale != "gpu":
        return list(settings.data)
    paths = sysconfig.get_paths()
    return sorted({Path(paths["stdlib"]), Path(paths["purelib"])})


def common_flags(settings: QualityBench) -> list[str]:
    """What every run shares: model, data, evaluation windows, seed, inner optimizer."""
    windows = settings.eval_windows or settings.eval_batches * settings.batch_size
    out = [
        *model_flags(settings),
        "--dtype",
        settings.dtype,
        "--eval-windows",
        str(windows),
        "--eval-every",
        "0",
        "--seed",
        str(settings.seed),
    ]
    data = data_paths(settings)
    if data:
        out += ["--data", json.dumps([str(p) for p in data])]
    if settings.eval_data:
        out += ["--eval-data", json.dumps([str(p) for p in settings.eval_data])]
    if settings.lr is not None:
        out += ["--lr", str(settings.lr)]
    if settings.warmup_steps is not None:
        out += ["--warmup-steps", str(settings.warmup_steps)]
    return out


def outer_flags(settings: QualityBench) -> list[str]:
    out: list[str] = []
    if settings.outer_lr is not None:
        out += ["--outer-lr", str(settings.outer_lr)]
    if settings.outer_momentum is not None:
        out += ["--outer-momentum", str(settings.outer_momentum)]
    return out


def eval_command(settings: QualityBench, model_file: Path) -> list[str]:
    """The `atoll eval` arguments that score `model_file` as the runs were scored."""
    data = data_paths(settings)
    held_out = not settings.eval_data
    paths = settings.eval_data or data
    windows = settings.eval_windows or settings.eval_batches * settings.batch_size
    return [
        "eval",
        "--model-file",
        str(model_file),
        *(["--data", json.dumps([str(p) for p in paths])] if paths else []),
        *(["--held-out"] if held_out else []),
        "--windows",
        str(windows),
        "--batch-size",
        str(settings.batch_size),
        "--dtype",
        settings.dtype,
    ]


def learner_flags(settings: QualityBench, m: int, steps: int) -> list[str]:
    """M learners of `steps` inner steps each, as the settings place and feed them."""
    return [
        "--learners",
        str(m),
        "--steps",
        str(steps),
        "--threads",
        str(settings.threads),
        "--batch-size",
        str(settings.batch_size),
        "--fragments",
        str(settings.fragments),
        "--gpus-per-learner",
        str(settings.gpus_per_learner),
    ]


def planned(settings: QualityBench) -> list[tuple[str, list[str]]]:
    """(name, flags) of each run this invocation makes, besides dp."""
    learners = learner_flags(settings, settings.learners, steps_of(settings))
    learners += outer_flags(settings)
    out: list[tuple[str, list[str]]] = []
    for h in settings.inner_steps:
        at_h = [*learners, "--inner-steps", str(h)]
        if "sync" in settings.runs:
            fp32 = ["--codec", "fp32", "--downlink-codec", "fp32"]
            out.append((f"sync-fp32-h{h}", [*at_h, "--mode", "sync", *fp32]))
        if "decoupled" in settings.runs:
            for codec in settings.codecs:
                both = ["--codec", codec, "--downlink-codec", codec]
                decoupled = [*at_h, "--mode", "decoupled", "--no-shared-budget", *both]
                if settings.quorum is not None:
                    decoupled += ["--quorum", str(settings.quorum)]
                out.append((f"decoupled-{codec}-h{h}", decoupled))
    return out


def summarize(report: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "eval_loss": report["eval_loss"],
        "bandwidth_reduction": report["bandwidth_reduction"],
        "tokens": report["tokens_total"],
        "bytes": report["bytes"]["up"] + report["bytes"]["down"],
        "parameters": report["parameters"],
        "wall_seconds": report["wall_seconds"],
        "goodput": report["goodput"],
        "versions_committed": report["versions_committed"],
        **extra,
    }


def gaps(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Relative eval-loss gaps: every run against dp, every decoupled run against the sync
    run of its H."""

    def gap(a: str, b: str) -> float:
        loss, reference = float(runs[a]["eval_loss"]), float(runs[b]["eval_loss"])
        return round((loss - reference) / reference, 4)

    out: dict[str, float] = {}
    for name in runs:
        if name != "dp" and "dp" in runs:
            out[f"{name}_vs_dp"] = gap(name, "dp")
        if name.startswith("decoupled-"):
            sync = f"sync-fp32-{name.rsplit('-', 1)[1]}"
            if sync in runs:
                out[f"{name}_vs_{sync}"] = gap(name, sync)
    return out


def result(
    settings: QualityBench, runs: dict[str, dict[str, Any]], checks: dict[str, Any] | None = None
) -> dict[str, Any]:
    found = gaps(runs)
    decoupled = [n for n in runs if n.startswith("decoupled-") and f"{n}_vs_dp" in found]
    best = min(decoupled, key=lambda n: found[f"{n}_vs_dp"], default=None)
    out: dict[str, Any] = {
        "scale": settings.scale,
        "learners": settings.learners,
        "steps": steps_of(settings),
        "model": {
            "layers": settings.layers,
            "width": settings.width,
            "heads": settings.heads,
            "context": settings.context,
            "batch_size": settings.batch_size,
            "dtype": settings.dtype,
        },
        "runs": runs,
        "gaps": found,
        "best_decoupled": best,
        **(checks or {}),
    }
    # The keys of the first version of this bench, for tools that read them.
    sync = next((n for n in runs if n.startswith("sync-")), None)
    if "dp" in runs and sync is not None:
        out["sync_vs_dp_loss_gap"] = found[f"{sync}_vs_dp"]
    if "dp" in runs and decoupled:
        out["decoupled_vs_dp_loss_gap"] = found[f"{decoupled[0]}_vs_dp"]
    return out


def sanity(settings: QualityBench, common: list[str], root: Path) -> dict[str, Any]:
    """One learner through the decoupled path, each merge the identity, against itself
    alone: the largest difference of their training losses, step by step."""
    steps, h = settings.sanity_steps, settings.inner_steps[0]
    one = [*common, *learner_flags(settings, 1, steps), *IDENTITY_MERGE, "--log-every", "1"]
    curves = {}
    for name, flags in {
        "alone": ["--mode", "sync", "--inner-steps", str(steps)],
        "decoupled": ["--mode", "decoupled", "--inner-steps", str(h)],
    }.items():
        up(root / f"sanity-{name}", [*one, *flags])
        (summary,) = learner_summaries(root / f"sanity-{name}")
        curves[name] = {step: loss for _, step, _, loss in summary["losses"]}
    shared = sorted(set(curves["alone"]) & set(curves["decoupled"]))
    diffs = [abs(curves["alone"][s] - curves["decoupled"][s]) for s in shared]
    worst = max(range(len(shared)), key=diffs.__getitem__)
    return {
        "steps": steps,
        "inner_steps": h,
        "fragments": settings.fragments,
        "compared_steps": len(shared),
        "max_abs_loss_diff": round(diffs[worst], 6),
        "at_step": shared[worst],
        "max_rel_loss_diff": round(
            max(d / abs(curves["alone"][s]) for d, s in zip(diffs, shared, strict=True)), 6
        ),
        "final_loss_alone": curves["alone"][shared[-1]],
        "final_loss_decoupled": curves["decoupled"][shared[-1]],
    }


def check_export(settings: QualityBench, name: str, workdir: Path) -> dict[str, Any]:
    """Score the run's exported model with `atoll eval` (it should give the run's loss)."""
    if settings.export_dir is None:
        return {}
    model_file = settings.export_dir / f"{name}.safetensors"
    scored = workdir / "eval.json"
    atoll([*eval_command(settings, model_file), "--json", str(scored)])
    return {
        "model_file": str(model_file),
        "eval_loss_exported": json.loads(scored.read_text())["eval_loss"],
    }


def export_flags(settings: QualityBench, name: str) -> list[str]:
    if settings.export_dir is None:
        return []
    return ["--export", str(settings.export_dir / f"{name}.safetensors")]


def run(settings: QualityBench) -> None:
    m, steps = settings.learners, steps_of(settings)
    common = common_flags(settings)
    runs: dict[str, dict[str, Any]] = {}
    checks: dict[str, Any] = {}
    if settings.baseline is not None:
        earlier = json.loads(settings.baseline.read_text())
        mine = result(settings, {})
        for key in ("scale", "learners", "steps", "model"):
            if earlier.get(key) != mine[key]:
                raise ValueError(
                    f"--baseline {settings.baseline} was run with {key} {earlier.get(key)}, "
                    f"this bench with {mine[key]}: its runs are not comparable"
                )
        runs.update(earlier["runs"])
        if "sanity" in earlier:
            checks["sanity"] = earlier["sanity"]
    with tempfile.TemporaryDirectory(prefix="atoll-quality-") as tmp:
        root = Path(tmp)
        if "sanity" in settings.runs:
            checks["sanity"] = sanity(settings, common, root)
            write(result(settings, runs, checks), settings.json_path)
        if "dp" in settings.runs:
            dp = data_parallel(
                root / "dp",
                [*common, *export_flags(settings, "dp")],
                m,
                steps,
                settings.batch_size,
                threads=max(2, settings.threads),
            )
            runs["dp"] = summarize(
                dp,
                bytes=int(dp_equivalent_bytes(dp["parameters"], m, m * steps)),
                bandwidth_reduction=1.0,
                **check_export(settings, "dp", root / "dp"),
            )
            write(result(settings, runs, checks), settings.json_path)
        for name, flags in planned(settings):
            report = up(root / name, [*common, *flags, *export_flags(settings, name)])
            runs[name] = summarize(report, **check_export(settings, name, root / name))
            write(result(settings, runs, checks), settings.json_path)
