"""`atoll up --metrics`: every process serves /metrics on a loopback port, listed for
Prometheus in a file_sd JSON file.

Each target carries stable labels: `slot` (learner-0, synchronizer-1: the same across
restarts, which come back on the same port), `role` (learner, synchronizer, cluster),
`pool` (the learner pool; `main` under `atoll up`), `job` as the chart's monitors set it
(atoll-learner, atoll-synchronizer; atoll-up for the cluster tool), which wins over the
scrape config's `job_name`, `atoll_job` (the training job, `--job`: what the rules group by
and the dashboard's `job` variable selects, as under the chart) and `run` (this run of
`atoll up`: slot names repeat from one run to the next, and a slot's restarts are counted
within one run). The file is rewritten whenever a process is launched, so Prometheus
follows restarts and scaling, and emptied when `atoll up` exits, however it exits: a
process that is gone is not a target that is down. The `cluster` target is `atoll up`
itself: it exports `atoll_provisioned_seconds_total{slot}` for every learner slot, dead and
restarting time included, which a learner cannot export while it is down.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

POOL = "main"
JOBS = {"learner": "atoll-learner", "synchronizer": "atoll-synchronizer", "cluster": "atoll-up"}


@dataclass(frozen=True)
class Target:
    address: str
    role: str
    slot: str = ""

    def as_file_sd(self, common: dict[str, str] | None = None) -> dict[str, object]:
        labels = {"job": JOBS[self.role], "role": self.role, **(common or {})}
        if self.slot:
            labels |= {"slot": self.slot}
        if self.role == "learner":
            labels |= {"pool": POOL}
        return {"targets": [self.address], "labels": labels}


def write_file_sd(path: Path, targets: list[Target], common: dict[str, str] | None = None) -> None:
    """Write atomically: Prometheus re-reads the file when it changes and must never see
    half of it. `common`: labels every target carries (`atoll_job`, `run`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([t.as_file_sd(common) for t in targets], indent=2) + "\n")
    os.replace(tmp, path)


def run_label(started: float) -> str:
    """A run's `run` label: its start time in UTC, to the second."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
