"""`atoll sim`: the table, the plot, one job, or a tape's replay."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

from cluster.chaos import ChaosError, parse_duration
from services import tape
from sim.engine import Mode, simulate
from sim.model import DEFAULT, FailureModel
from sim.replay import replay
from sim.settings import SimSettings

CHIPS = [150_000, 300_000, 600_000, 1_200_000, 2_400_000]
MODES: dict[str, tuple[Mode, int]] = {
    "dp": ("dp", 1),
    "elastic_dp": ("elastic_dp", 1),
    "decoupled_m8": ("decoupled", 8),
    "decoupled_m16": ("decoupled", 16),
}
LABELS = {
    "dp": "data-parallel",
    "elastic_dp": "elastic data-parallel",
    "decoupled_m8": "decoupled, M=8",
    "decoupled_m16": "decoupled, M=16",
}


def table(model: FailureModel, seed: int) -> dict[str, Any]:
    goodput: dict[str, list[float]] = {}
    uptime: dict[str, list[float]] = {}
    events: dict[str, list[dict[str, int]]] = {}
    for key, (mode, learners) in MODES.items():
        runs = [simulate(model, mode, chips, learners, seed) for chips in CHIPS]
        goodput[key] = [round(r.goodput, 4) for r in runs]
        uptime[key] = [round(r.uptime, 4) for r in runs]
        events[key] = [r.events for r in runs]
    return {
        "chips": CHIPS,
        "goodput": goodput,
        "uptime": uptime,
        "events": events,
        "parameters": asdict(model),
        "seed": seed,
    }


def render(result: dict[str, Any]) -> str:
    chips = result["chips"]
    head = f"{'goodput %':<24}" + "".join(f"{_chips(c):>9}" for c in chips)
    rows = [
        f"{LABELS[key]:<24}" + "".join(f"{100 * g:>9.1f}" for g in values)
        for key, values in result["goodput"].items()
    ]
    return "\n".join([head, *rows])


def _chips(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n // 1000}k"


def plot(model: FailureModel, seed: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = [75_000, *CHIPS, 4_800_000]
    mtbi = [0.25, 0.5, 1.0, 2.0, 4.0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, (mode, learners) in MODES.items():
        left.plot(
            scale,
            [100 * simulate(model, mode, c, learners, seed).goodput for c in scale],
            marker="o",
            label=LABELS[key],
        )
        right.plot(
            [1.0 / y for y in mtbi],
            [
                100
                * simulate(
                    model.with_changes(chip_mtbi_years=y), mode, 1_200_000, learners, seed
                ).goodput
                for y in mtbi
            ],
            marker="o",
            label=LABELS[key],
        )
    left.set(xscale="log", xlabel="chips", ylabel="goodput %", ylim=(0, 100))
    left.set_title(f"goodput against scale (chip MTBI {model.chip_mtbi_years:g} year)")
    right.set(xscale="log", xlabel="interruptions per chip-year", ylabel="goodput %", ylim=(0, 100))
    right.set_title("goodput against failure rate (1.2M chips)")
    rates = [1.0 / y for y in mtbi]
    right.set_xticks(rates, [f"{r:g}" for r in rates])
    right.minorticks_off()
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    left.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def run(settings: SimSettings) -> int:
    model = DEFAULT.with_changes(
        chip_mtbi_years=settings.chip_mtbi_years, horizon_s=settings.horizon_days * 86400.0
    )
    result: dict[str, Any]
    if settings.tape is not None:
        try:
            mtbf = parse_duration(settings.mtbf) if settings.mtbf else None
        except ChaosError as err:
            raise ValueError(f"--mtbf: {err}") from None
        result = replay(
            tape.read(settings.tape),
            mtbf_s=mtbf,
            learners=settings.learners,
            quorum=settings.quorum,
            grace_s=settings.grace if settings.grace >= 0 else None,
            seed=settings.seed,
        )
        print(json.dumps(result, indent=2))
    elif settings.table or settings.plot is not None:
        result = table(model, settings.seed)
        if settings.table:
            print(render(result))
        if settings.plot is not None:
            plot(model, settings.seed, settings.plot)
            print(f"atoll sim: plot written to {settings.plot}")
    elif settings.chips:
        if settings.mode not in ("dp", "elastic_dp", "decoupled"):
            raise ValueError(f"--mode {settings.mode!r}: use dp, elastic_dp or decoupled")
        r = simulate(
            model, cast(Mode, settings.mode), settings.chips, settings.sim_learners, settings.seed
        )
        result = {"goodput": round(r.goodput, 4), "uptime": round(r.uptime, 4), **asdict(r)}
        print(json.dumps(result, indent=2))
    else:
        raise ValueError("give --table, --plot PATH, --chips N or --tape PATH (see --help)")
    if settings.json_path is not None:
        settings.json_path.parent.mkdir(parents=True, exist_ok=True)
        settings.json_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0
