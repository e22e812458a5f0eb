"""Settings of `atoll sim`: the failure model's parameters as flags, and what to produce."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from services.config import AtollSettings
from sim.model import DEFAULT


class SimSettings(AtollSettings):
    """`atoll sim`: goodput of data-parallel, elastic data-parallel and decoupled training at
    scale, from a discrete-event simulation; or the replay of a real run's tape."""

    table: bool = Field(
        False,
        description="goodput at 150k, 300k, 600k, 1.2M and 2.4M chips for data-parallel, "
        "elastic data-parallel and decoupled with 8 and 16 learners",
    )
    plot: Path | None = Field(
        None, description="write a PNG of goodput against chips and against failure rate"
    )
    json_path: Path | None = Field(None, alias="json", description="write the result JSON here")
    tape: Path | None = Field(
        None,
        description="replay the tape of an `atoll up --tape` run: reproduce its goodput, and "
        "with --mtbf/--quorum/--learners/--grace answer what-ifs on it",
    )
    mtbf: str = Field(
        "",
        description="replay what-if: mean time between learner interruptions across the run "
        "(e.g. 30s, 2m); empty: the tape's own faults",
    )
    quorum: int = Field(0, ge=0, description="replay what-if: quorum K; 0: the run's")
    learners: int = Field(0, ge=0, description="replay what-if: learners M; 0: the run's")
    grace: float = Field(-1.0, description="replay what-if: fixed grace seconds; -1: the run's")
    seed: int = Field(0, description="seed of the simulated interruptions")
    chips: int = Field(
        0, ge=0, description="simulate one job of this many chips (with --mode, --sim-learners)"
    )
    mode: str = Field("decoupled", description="dp, elastic_dp or decoupled (with --chips)")
    sim_learners: int = Field(8, ge=1, description="decoupled learners M (with --chips)")
    chip_mtbi_years: float = Field(
        DEFAULT.chip_mtbi_years, gt=0.0, description="mean time between interruptions per chip"
    )
    horizon_days: float = Field(
        DEFAULT.horizon_s / 86400.0, gt=0.0, description="virtual days each simulation runs"
    )
