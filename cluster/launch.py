"""How `atoll up` starts each child: its command line, environment and log.

A learner slot's flags say which synchronizers it talks to (through the fault proxy, where
there is one), its data shard, speed and batch, where its summary goes, and whether it is
one process or several; a synchronizer's transport flags come from here too.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.faultproxy import FaultProxy
from cluster.processes import Child, accelerators_present, atoll_command, child_env, gpu_pinning
from cluster.regions import RegionPlan
from cluster.settings import UpSettings
from learner.settings import ModelConfig
from services import tls
from synchronizer.core.merge import REGISTRY

COORDINATOR_PORT = 7777  # data-parallel's coordination service, in a fresh namespace
LINGER_S = 600.0


def flags(model: Any, fields: Any) -> list[str]:
    """Command-line flags for the given fields of a settings model (None values skipped)."""
    out: list[str] = []
    for name in fields:
        value = getattr(model, name)
        if value is None or (isinstance(value, list) and not value):
            continue
        flag = name.replace("_", "-")
        if isinstance(value, bool):  # implicit flags: --name / --no-name
            out.append(f"--{flag}" if value else f"--no-{flag}")
            continue
        if isinstance(value, list):
            value = json.dumps([str(v) for v in value])
        out += [f"--{flag}", str(value)]
    return out


def default_compile_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "atoll" / "compile"


class Launcher:
    """The command lines of one run's children."""

    def __init__(
        self, settings: UpSettings, workdir: Path, regions: RegionPlan | None, job_steps: int
    ) -> None:
        self.settings = settings
        self.workdir = workdir
        self.regions = regions  # --regions: each learner starts in its region's namespace
        self.job_steps = job_steps
        self.slots_ever = settings.learners  # data shards: one per slot the job will have
        self.tape_args = ["--tape", str(settings.tape)] if settings.tape is not None else []

    @functools.cached_property
    def transport(self) -> Callable[[str | None], list[str]]:
        """Each child's transport flags (None: a synchronizer's): with --tls, a throwaway CA
        (made on first use) and mTLS everywhere; otherwise plaintext on loopback."""
        if not self.settings.tls:
            return lambda _: ["--insecure"]
        files = tls.generate(
            self.workdir / "tls", [f"learner-{i}" for i in range(self.settings.learners)]
        )

        def flags(slot: str | None) -> list[str]:
            if slot is None:
                cert, key = files.server_cert, files.server_key
            else:
                cert, key = files.client(slot)
            return ["--tls-ca", str(files.ca), "--tls-cert", str(cert), "--tls-key", str(key)]

        return flags

    def learner(
        self, i: int, addresses: list[str], proxy: FaultProxy | None, metrics_args: list[str]
    ) -> Child:
        """Learner slot i (not started): its synchronizers (through the proxy, where there is
        one), data shard, speed and batch."""
        name = f"learner-{i}"
        order = proxy.addresses[i] if proxy and i < self.settings.learners else addresses
        # Owners are reached through the same proxy as the session: a fault cuts both.
        routes = (
            [f"{a}={p}" for a, p in zip(addresses, order, strict=True)]
            if order != addresses
            else []
        )
        order = order[i % len(order) :] + order[: i % len(order)]  # spread over replicas
        # Every learner evaluates the same global model: they take turns, so the cluster
        # evaluates about every --eval-every steps and no learner spends M times that.
        model_args = flags(
            self.settings, [f for f in ModelConfig.model_fields if f != "eval_every"]
        )
        turns = self.settings.eval_every * self.settings.learners
        args = atoll_command(
            "learner",
            *self.transport(name),
            *model_args,
            "--eval-every",
            str(turns),
            "--eval-offset",
            str(i * self.settings.eval_every),
            "--synchronizer",
            ",".join(order),
            *(["--route", ",".join(routes)] if routes else []),
            "--id",
            name,
            "--job",
            self.settings.job,
            "--steps",
            str(self.job_steps or self.settings.steps),  # with a budget, only a cap
            "--lr-horizon-steps",
            str(self.settings.steps),
            "--compile-cache",
            str(self.settings.compile_cache or default_compile_cache()),
            *self.tape_args,
            "--shard",
            str(i),
            "--num-shards",
            str(self.slots_ever),
            "--speed",
            str(self.settings.speeds[i] if i < len(self.settings.speeds) else 1.0),
            "--batch-size",
            str(self.batch_size(i)),
            "--state-dir",
            str(self.workdir / "state"),
            "--report",
            str(self.summary_path(name, 1)),
            "--linger-s",
            str(LINGER_S),
            "--max-backoff-s",
            "2",
            "--log-every",
            str(self.settings.log_every),
            *metrics_args,
            *self.processes_args(),
            *(["--hostile", self.settings.hostile[name]] if name in self.settings.hostile else []),
        )
        env = child_env(self.settings.threads, self.devices(i), accelerators=True)
        if self.regions is not None:
            args = self.regions.in_region(i, args)  # started inside its region's namespace
        return Child(name, args, self.workdir / f"{name}.log", env)

    def data_parallel_processes(self) -> int:
        """--data-parallel: one process per slot of the regions (0: not data-parallel)."""
        return self.regions.learners if self.settings.data_parallel and self.regions else 0

    def data_parallel_args(self, k: int) -> list[str]:
        """Process k of the data-parallel learner: process 0's coordination service on its
        region's address; its own collectives on its own region's address."""
        assert self.regions is not None
        first = self.regions.of_learner(0).region_address
        return [
            "--processes", str(self.data_parallel_processes()),
            "--process-id", str(k),
            "--coordinator", f"{first}:{COORDINATOR_PORT}",
            "--collectives-host", self.regions.of_learner(k).region_address,
        ]  # fmt: skip

    def follower(self, k: int, leader: Child) -> Child:
        """Process k >= 1 of the data-parallel learner (`leader` its process 0), in the region
        of slot k; its report goes beside the leader's (learner/main.py names it)."""
        assert self.regions is not None
        at = leader.args.index("--process-id") + 1
        args = [*leader.args[:at], str(k), *leader.args[at + 1 :]]
        at = args.index("--collectives-host") + 1
        args[at] = self.regions.of_learner(k).region_address
        ip_netns_exec = 4  # the leader's `ip netns exec NAMESPACE`, replaced by k's
        args = self.regions.in_region(k, args[ip_netns_exec:])
        name = f"learner-0.process-{k}"
        return Child(name, args, self.workdir / f"{name}.log", dict(leader.env))

    def processes_args(self) -> list[str]:
        """A slot of several processes: its first starts the others (one GPU each)."""
        if self.data_parallel_processes():
            return self.data_parallel_args(0)
        n = self.settings.processes_per_learner
        if n == 1:
            return []
        if not REGISTRY[self.settings.merge].sums_in_parts:
            parts = ", ".join(n for n, rule in REGISTRY.items() if rule.sums_in_parts)
            raise ValueError(
                "--processes-per-learner: each process sends its own part of an update, which "
                f"only a merge rule that sums in parts can take (--merge {parts})"
            )
        return ["--processes", str(n), "--local-processes"]

    def devices(self, learner: int) -> dict[str, str]:
        """Learner i's GPUs with --gpus-per-learner (a slot of several processes: one each,
        by default); without it every learner sees every device, so none may take most of a
        GPU's memory up front."""
        per = self.settings.gpus_per_learner
        if not per and self.settings.processes_per_learner > 1 and accelerators_present():
            per = self.settings.processes_per_learner
        if per:
            return gpu_pinning(learner, per)
        return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"} if self.slots_ever > 1 else {}

    def batch_sizes(self) -> list[int]:
        """Each learner's batch size: --batch-sizes, or --batch-size for all."""
        return self.settings.batch_sizes or [self.settings.batch_size] * self.settings.learners

    def batch_size(self, i: int) -> int:
        """Slot i's batch size (a slot added by --scale: --batch-size)."""
        return (
            self.settings.batch_sizes[i]
            if i < len(self.settings.batch_sizes)
            else self.settings.batch_size
        )

    def summary_path(self, name: str, launch: int) -> Path:
        """Where the slot's `launch`th incarnation writes its summary (`read_summaries`)."""
        return self.workdir / f"{name}.{launch}.summary.json"
