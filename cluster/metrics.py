"""`atoll up --metrics`: every process serves /metrics on a loopback port, listed for
Prometheus in a file_sd JSON file.

Each target carries stable labels: `slot` (learner-0, synchronizer-1: the same across
restarts, which come back on the same port), `role` (learner, synchronizer, cluster),
`pool` (the learner pool; `main` under `atoll up`) and `job` as the chart's monitors set it
(atoll-learner, atoll-synchronizer; atoll-up for the cluster tool), which the alert rules
select on and which wins over the scrape config's `job_name`. The file is rewritten
whenever a process is launched, so Prometheus follows restarts and scaling. The `cluster`
target is `atoll up` itself: it exports `atoll_provisioned_seconds_total{slot}` for every
learner slot, dead and restarting time included, which a learner cannot export while it is
down.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

POOL = "main"
JOBS = {"learner": "atoll-learner", "synchronizer": "atoll-synchronizer", "cluster": "atoll-up"}


@dataclass(frozen=True)
class Target:
    address: str
    role: str
    slot: str = ""

    def as_file_sd(self) -> dict[str, object]:
        labels = {"job": JOBS[self.role], "role": self.role}
        if self.slot:
            labels |= {"slot": self.slot}
        if self.role == "learner":
            labels |= {"pool": POOL}
        return {"targets": [self.address], "labels": labels}


def write_file_sd(path: Path, targets: list[Target]) -> None:
    """Write atomically: Prometheus re-reads the file when it changes and must never see
    half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([t.as_file_sd() for t in targets], indent=2) + "\n")
    os.replace(tmp, path)
