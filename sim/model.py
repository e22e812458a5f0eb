"""The failure model of `atoll sim`: every parameter, its default and where it comes from.

One parameter set serves every mode and every scale; docs/simulator.md explains each.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

YEAR_S = 365.0 * 24 * 3600


@dataclass(frozen=True)
class FailureModel:
    # --- the hardware -----------------------------------------------------------------------
    chip_mtbi_years: float = 1.0  # mean time between interruptions of one chip
    slice_chips: int = 256  # chips that go down together (a host group / slice)
    # --- what an interruption costs ----------------------------------------------------------
    detect_s: float = 5.0  # from the fault to the system acting on it (health-check timeout)
    replace_s: float = 10.0  # a spare slice scheduled in place of the failed one
    restart_s: float = 49.0  # data-parallel: every process restarts, reloads the checkpoint
    # and re-forms the job-wide collectives
    rejoin_s: float = 3.0  # decoupled: a learner's processes restart and fetch the global
    # model from the synchronizer (no checkpoint reload, collectives of one learner only)
    checkpoint_interval_s: float = 0.5  # data-parallel keeps an in-memory copy of its state
    # on peers every step, so an interruption loses the step in progress...
    checkpoint_cost_s: float = 0.05  # ...at this cost per copy
    reshard_s: float = 20.0  # elastic data-parallel: re-forming the job on fewer/more slices
    # --- training ----------------------------------------------------------------------------
    step_s: float = 0.5  # inner step time
    inner_steps: int = 24  # H: a learner's unsynced work is H*step/2 on average
    fragments: int = 4  # P
    overlap_steps: int = 5  # tau: a learner keeps training this long while a sync is in flight
    quorum: int = 1  # K: learners a merge needs
    grace_s: float = 0.0  # extra wait for more learners once the quorum is met
    step_cv: float = 0.0  # heterogeneity: coefficient of variation of learners' step times
    slowdown_rate_per_chip_year: float = 0.0  # transient slowdowns per chip-year
    slowdown_s: float = 300.0  # how long a slowdown lasts
    slowdown_factor: float = 1.5  # how much slower a slowed slice steps
    startup_s: float = 300.0  # the job's start: scheduling, loading, compiling
    # --- the run -----------------------------------------------------------------------------
    horizon_s: float = 14 * 24 * 3600.0  # virtual time simulated

    def failure_rate(self, chips: int) -> float:
        """Interruptions per second among `chips` chips."""
        return chips / (self.chip_mtbi_years * YEAR_S)

    def with_changes(self, **changes: Any) -> FailureModel:
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown simulator parameters {sorted(unknown)}")
        return replace(self, **changes)


DEFAULT = FailureModel()
