"""`atoll bench quality`: one model, the same text, several ways, at least two seeds each.

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

Like with like, enforced: every run reads one token stream (`--data-split windows`), so M
learners' batches at step k together hold exactly the windows of data-parallel's batch k.
Each run's report carries a fingerprint of the windows it trained on and of its evaluation
windows; the bench fails when two runs of one seed trained on different windows, or any two
runs were scored on different ones. Every run's final global model is exported and scored
by `atoll eval`, on the held-out files and on `--ood-data` (text nobody chose) when given.
Each row runs once per seed; the result gives each row's mean and spread, and a gap is
called beyond noise only when it is larger than both rows' spreads.

The result is written after each run, so a long bench split over several invocations
(`--runs`, `--baseline`) or cut short keeps what it measured.
"""

from __future__ import annotations

import json
import math
import sysconfig
import tempfile
from pathlib import Path
from statistics import mean
from typing import Any, Literal

from pydantic import Field, model_validator

from bench.options import Model, Output
from bench.runs import (
    IDENTITY_MERGE,
    atoll,
    data_parallel,
    learner_summaries,
    model_flags,
    up,
    write,
)
from learner.data import MAX_CORPUS_BYTES
from services.bandwidth import dp_equivalent_bytes


class QualityBench(Model, Output):
    """Eval loss on the same text: data-parallel, sync DiLoCo (fp32) and decoupled (sweeping
    codec and H), M learners each, every row once per seed; every run's final global model
    scored on held-out files and on --ood-data. `--scale` picks a preset; flags given win."""

    scale: Literal["custom", "gpu", "cpu-smoke"] = Field(
        "custom",
        description="gpu: a 32.3M-parameter model (8 layers, width 576, context 512) for 20 "
        "tokens per parameter (650M tokens per run), M=2, one learner per GPU (data-parallel "
        "spans them all); cpu-smoke: a tiny model for a minute or two on a CPU; custom: the "
        "flags alone",
    )
    learners: int = Field(4, ge=2, le=16, description="M")
    steps: int = Field(150, ge=1, description="inner steps per learner (unless --tokens)")
    tokens: int = Field(
        0,
        ge=0,
        description="tokens each run trains on in all (sets --steps: tokens / (M x batch x "
        "context), rounded up); 0: --steps",
    )
    inner_steps: list[int] = Field([12], description="H values (sync and decoupled runs)")
    fragments: int = Field(3, ge=1, description="P")
    codecs: list[str] = Field(
        ["int8"], description="codecs of the decoupled runs (both directions)"
    )
    runs: list[Literal["dp", "sync", "decoupled", "sanity"]] = Field(
        ["dp", "sync", "decoupled"],
        description="which kinds of run this invocation makes (split a long bench over "
        "several invocations with --baseline); sanity: one learner through the decoupled "
        "path (fp32, outer lr 1, no momentum) against the same learner alone, step by step",
    )
    sanity_steps: int = Field(300, ge=2, description="inner steps of each sanity run")
    baseline: Path | None = Field(
        None,
        description="an earlier result JSON of this bench: its runs join this one's (gaps "
        "are computed over both)",
    )
    lr: float | None = Field(
        None, gt=0.0, description="inner AdamW peak lr of the DiLoCo runs; unset: the learner's"
    )
    dp_lr: float | None = Field(
        None,
        gt=0.0,
        description="inner AdamW peak lr of data-parallel (tune each side: its global batch is "
        "M times a learner's); unset: --lr",
    )
    weight_decay: float = Field(0.01, ge=0.0, description="inner AdamW weight decay, every run")
    warmup_steps: int | None = Field(
        None, ge=0, description="inner warm-up steps; unset: the learner's"
    )
    outer_lr: float | None = Field(None, gt=0.0, description="outer lr; unset: the job's")
    quorum: int | None = Field(
        None, ge=1, description="K of the decoupled runs; unset: the job's (every live learner)"
    )
    outer_momentum: float | None = Field(
        None, ge=0.0, lt=1.0, description="outer Nesterov momentum; unset: the job's"
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="compute dtype (auto: bfloat16 on GPU, float32 on CPU)"
    )
    threads: int = Field(1, ge=1, description="CPU threads of each learner")
    gpus_per_learner: int = Field(
        0, ge=0, description="GPUs of each sync/decoupled learner (1: one per GPU); 0: unpinned"
    )
    data: list[Path] = Field(
        default_factory=list,
        description="training text; empty: this Python's standard library (gpu: with its "
        "site-packages too)",
    )
    eval_data: list[Path] = Field(
        default_factory=list,
        description="evaluation text; empty: every 50th file of --data, held out",
    )
    ood_data: list[Path] = Field(
        default_factory=list,
        description="a second evaluation corpus nobody trained or tuned on (prose, another "
        "project's sources): every run's final model is scored on it too",
    )
    max_corpus_bytes: int = Field(
        MAX_CORPUS_BYTES,
        ge=1 << 10,
        description="training text read, the same first bytes of the files for every run "
        "(the result says when it cut the text)",
    )
    eval_batches: int = Field(16, ge=1, description="eval batches (x batch size sequences)")
    eval_windows: int = Field(
        0, ge=0, description="windows every run is scored on; 0: --eval-batches x --batch-size"
    )
    export_dir: Path | None = Field(
        None,
        description="export each run's final model here (safetensors) and check that "
        "`atoll eval` of it gives the run's eval loss",
    )
    seeds: list[int] = Field(
        [0, 1],
        min_length=1,
        description="initialization and data-order seeds: every row runs once per seed (two "
        "at least, to see the noise a gap must beat)",
    )

    @model_validator(mode="after")
    def _preset(self) -> QualityBench:
        for name, value in QUALITY_PRESETS.get(self.scale, {}).items():
            if name not in self.model_fields_set:
                setattr(self, name, value)
        return self

    def cli_cmd(self) -> None:
        run(self)


QUALITY_PRESETS: dict[str, dict[str, Any]] = {
    # 32.3M parameters at 20 tokens per parameter (the DiLoCo scaling-law studies' regime):
    # one learner per GPU of a 2-GPU pair, 64 sequences of 512 bytes per learner step, 9,919
    # steps = 650M tokens, about 1.3 passes over the standard library and site-packages.
    "gpu": {
        "layers": 8,
        "width": 576,
        "heads": 9,
        "context": 512,
        "batch_size": 64,
        "learners": 2,
        "tokens": 650_000_000,
        "inner_steps": [100],
        "fragments": 4,
        "codecs": ["int4", "int2"],
        "lr": 2e-3,
        "warmup_steps": 300,
        "threads": 4,
        "gpus_per_learner": 1,
        "eval_windows": 1024,
        "max_corpus_bytes": 1 << 30,
    },
    # The same three kinds of run at a size a test runs in a minute on a CPU.
    "cpu-smoke": {
        "layers": 1,
        "width": 32,
        "heads": 2,
        "context": 32,
        "batch_size": 4,
        "learners": 2,
        "steps": 20,
        "inner_steps": [10],
        "fragments": 2,
        "codecs": ["int4"],
        "eval_windows": 16,
    },
}


class UnequalText(RuntimeError):
    """Runs compared by the bench trained or were scored on different windows."""


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


def eval_windows_of(settings: QualityBench) -> int:
    return settings.eval_windows or settings.eval_batches * settings.batch_size


def common_flags(settings: QualityBench, seed: int) -> list[str]:
    """What every run of a seed shares: model, one token stream of the same text, the
    evaluation windows, the seed, the inner optimizer's schedule and weight decay."""
    out = [
        *model_flags(settings),
        "--dtype",
        settings.dtype,
        "--eval-windows",
        str(eval_windows_of(settings)),
        "--eval-every",
        "0",
        "--seed",
        str(seed),
        "--data-split",
        "windows",
        "--max-corpus-bytes",
        str(settings.max_corpus_bytes),
        "--weight-decay",
        str(settings.weight_decay),
    ]
    data = data_paths(settings)
    if data:
        out += ["--data", json.dumps([str(p) for p in data])]
    if settings.eval_data:
        out += ["--eval-data", json.dumps([str(p) for p in settings.eval_data])]
    if settings.warmup_steps is not None:
        out += ["--warmup-steps", str(settings.warmup_steps)]
    return out


def lr_flags(lr: float | None) -> list[str]:
    return [] if lr is None else ["--lr", str(lr)]


def outer_flags(settings: QualityBench) -> list[str]:
    out: list[str] = []
    if settings.outer_lr is not None:
        out += ["--outer-lr", str(settings.outer_lr)]
    if settings.outer_momentum is not None:
        out += ["--outer-momentum", str(settings.outer_momentum)]
    return out


def eval_command(settings: QualityBench, model_file: Path) -> list[str]:
    """The `atoll eval` arguments that score `model_file` as the runs were scored, and on
    --ood-data with as many windows."""
    paths = settings.eval_data or data_paths(settings)
    held_out = not settings.eval_data
    ood = json.dumps([str(p) for p in settings.ood_data])
    return [
        "eval",
        "--model-file",
        str(model_file),
        *(["--data", json.dumps([str(p) for p in paths])] if paths else []),
        *(["--held-out"] if held_out else []),
        *(["--ood-data", ood] if settings.ood_data else []),
        "--windows",
        str(eval_windows_of(settings)),
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
    """(row, flags) of each kind of run this invocation makes, besides dp."""
    learners = learner_flags(settings, settings.learners, steps_of(settings))
    learners += [*outer_flags(settings), *lr_flags(settings.lr)]
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


def run_name(row: str, seed: int) -> str:
    return f"{row}/seed{seed}"


def row_of(name: str) -> str:
    return name.rsplit("/seed", 1)[0]


def summarize(report: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "eval_loss_run": report["eval_loss"],
        "bandwidth_reduction": report["bandwidth_reduction"],
        "tokens": report["tokens_total"],
        "bytes": report["bytes"]["up"] + report["bytes"]["down"],
        "parameters": report["parameters"],
        "wall_seconds": report["wall_seconds"],
        "goodput": report["goodput"],
        "versions_committed": report["versions_committed"],
        "data": report.get("data", {}),
        **extra,
    }


def spread_of(values: list[float]) -> dict[str, Any]:
    return {
        "mean": round(mean(values), 6),
        "min": round(min(values), 6),
        "max": round(max(values), 6),
        "spread": round(max(values) - min(values), 6),
        "n": len(values),
    }


def rows(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each row (kind of run) over its seeds: eval and out-of-distribution loss as mean,
    min, max and spread; bytes and goodput as means."""
    out: dict[str, dict[str, Any]] = {}
    for row in sorted({row_of(n) for n in runs}):
        mine = [r for n, r in sorted(runs.items()) if row_of(n) == row]
        out[row] = {
            "seeds": [r["seed"] for r in mine],
            "eval_loss": spread_of([float(r["eval_loss"]) for r in mine]),
            "bandwidth_reduction": round(mean(float(r["bandwidth_reduction"]) for r in mine), 2),
            "goodput": round(mean(float(r["goodput"]) for r in mine), 4),
            "wall_seconds": round(mean(float(r["wall_seconds"]) for r in mine), 1),
        }
        ood = [float(r["ood_loss"]) for r in mine if r.get("ood_loss") is not None]
        if ood:
            out[row]["ood_loss"] = spread_of(ood)
    return out


def gap(table: dict[str, dict[str, Any]], a: str, b: str, key: str) -> dict[str, Any] | None:
    """Row a's mean `key` against row b's, relative; `beyond_spread` when the difference of
    the means is larger than each row's spread over its seeds."""
    if key not in table[a] or key not in table[b]:
        return None
    x, y = table[a][key], table[b][key]
    diff = x["mean"] - y["mean"]
    return {
        "gap": round(diff / y["mean"], 4),
        "beyond_spread": abs(diff) > max(x["spread"], y["spread"]),
    }


def gaps(table: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Relative gaps of the rows' means: every row against dp, every decoupled row against
    the sync row of its H; on the evaluation text, and on --ood-data as `..._ood`."""
    pairs: list[tuple[str, str]] = []
    for row in table:
        if row != "dp" and "dp" in table:
            pairs.append((row, "dp"))
        if row.startswith("decoupled-"):
            sync = f"sync-fp32-{row.rsplit('-', 1)[1]}"
            if sync in table:
                pairs.append((row, sync))
    out: dict[str, dict[str, Any]] = {}
    for a, b in pairs:
        for key, suffix in (("eval_loss", ""), ("ood_loss", "_ood")):
            found = gap(table, a, b, key)
            if found is not None:
                out[f"{a}_vs_{b}{suffix}"] = found
    return out


def fingerprints(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The windows each run trained on, by seed, and the windows every run was scored on;
    `equal` when every run of a seed trained on the same windows and all were scored on the
    same ones."""
    trained: dict[str, dict[str, str | None]] = {}
    for name, r in sorted(runs.items()):
        data = r.get("data") or {}
        by_seed = trained.setdefault(str(r["seed"]), {})
        by_seed[row_of(name)] = (data.get("trained") or {}).get("fingerprint")
    evaluated = {row_of(n): (r.get("data") or {}).get("evaluated") for n, r in sorted(runs.items())}
    same_text = all(
        None not in seed.values() and len(set(seed.values())) == 1 for seed in trained.values()
    )
    same_eval = None not in evaluated.values() and len(set(map(str, evaluated.values()))) <= 1
    return {
        "trained": trained,
        "evaluated": evaluated,
        "equal": same_text and same_eval,
    }


def result(
    settings: QualityBench, runs: dict[str, dict[str, Any]], checks: dict[str, Any] | None = None
) -> dict[str, Any]:
    table = rows(runs)
    found = gaps(table)
    decoupled = [r for r in table if r.startswith("decoupled-") and f"{r}_vs_dp" in found]
    best = min(decoupled, key=lambda r: found[f"{r}_vs_dp"]["gap"], default=None)
    data: dict[str, Any] = next((r["data"] for r in runs.values() if r.get("data")), {})
    out: dict[str, Any] = {
        "scale": settings.scale,
        "learners": settings.learners,
        "steps": steps_of(settings),
        "tokens_per_run": steps_of(settings)
        * settings.learners
        * settings.batch_size
        * settings.context,
        "model": {
            "layers": settings.layers,
            "width": settings.width,
            "heads": settings.heads,
            "context": settings.context,
            "batch_size": settings.batch_size,
            "dtype": settings.dtype,
        },
        "seeds": settings.seeds,
        "text": {
            "split": "windows",
            "train_bytes": data.get("train_bytes"),
            "cap_bytes": settings.max_corpus_bytes,
            "capped": data.get("capped"),
            "ood_data": [str(p) for p in settings.ood_data],
        },
        "runs": runs,
        "rows": table,
        "gaps": found,
        "best_decoupled": best,
        "fingerprints": fingerprints(runs),
        **(checks or {}),
    }
    if out["text"]["capped"]:
        out["text"]["note"] = (
            f"every run read the same first {data.get('train_bytes')} bytes of the training "
            f"files (--max-corpus-bytes {settings.max_corpus_bytes})"
        )
    return out


def sanity(settings: QualityBench, common: list[str], root: Path) -> dict[str, Any]:
    """One learner through the decoupled path, each merge the identity, against itself
    alone: the largest difference of their training losses, step by step."""
    steps, h = settings.sanity_steps, settings.inner_steps[0]
    one = [
        *common,
        *lr_flags(settings.lr),
        *learner_flags(settings, 1, steps),
        *IDENTITY_MERGE,
        "--log-every",
        "1",
    ]
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


def score(settings: QualityBench, model_file: Path, workdir: Path) -> dict[str, Any]:
    """The exported final global model scored by `atoll eval`: on the evaluation text, and
    on --ood-data when given."""
    scored = workdir / "scored.json"
    atoll([*eval_command(settings, model_file), "--json", str(scored)])
    found = json.loads(scored.read_text())
    return {
        "model_file": str(model_file),
        "eval_loss": found["eval_loss"],
        **({"ood_loss": found["ood_loss"]} if "ood_loss" in found else {}),
    }


def check_comparable(settings: QualityBench, earlier: dict[str, Any]) -> None:
    mine = result(settings, {})
    for key in ("scale", "learners", "steps", "model", "text"):
        theirs = earlier.get(key)
        if key == "text" and isinstance(theirs, dict):
            theirs = {**theirs, "train_bytes": None, "capped": None}
            mine[key] = {**mine[key], "train_bytes": None, "capped": None}
        if theirs != mine[key]:
            raise ValueError(
                f"--baseline {settings.baseline} was run with {key} {earlier.get(key)}, "
                f"this bench with {mine[key]}: its runs are not comparable"
            )


def run(settings: QualityBench) -> None:
    m, steps = settings.learners, steps_of(settings)
    runs: dict[str, dict[str, Any]] = {}
    checks: dict[str, Any] = {}
    if settings.baseline is not None:
        earlier = json.loads(settings.baseline.read_text())
        check_comparable(settings, earlier)
        runs.update(earlier["runs"])
        if "sanity" in earlier:
            checks["sanity"] = earlier["sanity"]
    with tempfile.TemporaryDirectory(prefix="atoll-quality-") as tmp:
        root = Path(tmp)
        models = settings.export_dir or root / "models"
        if "sanity" in settings.runs:
            common = common_flags(settings, settings.seeds[0])
            checks["sanity"] = sanity(settings, common, root)
            write(result(settings, runs, checks), settings.json_path)
        for seed in settings.seeds:
            for row, flags in [("dp", []), *planned(settings)]:
                if row == "dp" and "dp" not in settings.runs:
                    continue
                workdir = root / f"{row}-seed{seed}"
                model_file = models / f"{row}-seed{seed}.safetensors"
                common = [*common_flags(settings, seed), "--export", str(model_file)]
                if row == "dp":
                    lr = settings.dp_lr if settings.dp_lr is not None else settings.lr
                    report = data_parallel(
                        workdir,
                        [*common, *lr_flags(lr)],
                        m,
                        steps,
                        settings.batch_size,
                        threads=max(2, settings.threads),
                    )
                    extra = {
                        "bytes": int(dp_equivalent_bytes(report["parameters"], m, m * steps)),
                        "bandwidth_reduction": 1.0,
                    }
                else:
                    lr, extra = settings.lr, {}
                    report = up(workdir, [*common, *flags])
                scores = score(settings, model_file, workdir)
                runs[run_name(row, seed)] = summarize(report, seed=seed, lr=lr, **extra, **scores)
                write(result(settings, runs, checks), settings.json_path)
    final = result(settings, runs, checks)
    if not final["fingerprints"]["equal"]:
        raise UnequalText(
            "runs of one seed trained on different windows, or runs were scored on different "
            f"ones: {json.dumps(final['fingerprints'])}"
        )
