"""Settings of `atoll up`: the whole local cluster, algorithm and model included."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from cluster import regions
from cluster.chaos import ChaosError, parse
from cluster.scale import parse_scale
from learner.hostile import Hostility
from learner.settings import ModelConfig
from services.config import AtollSettings, JobConfig


class UpSettings(JobConfig, ModelConfig, AtollSettings):
    """`atoll up`: Redis, synchronizer replicas and learners on this machine."""

    learners: int = Field(3, ge=1, le=64, description="learner processes (M)")
    synchronizers: int = Field(1, ge=1, le=8, description="synchronizer replicas")
    steps: int = Field(
        200,
        ge=1,
        description="inner steps per learner slot: the job trains learners x steps inner steps "
        "in all, so a learner a fault slowed or stopped does fewer and the others more "
        "(--job-steps sets that total directly)",
    )
    compile_cache: Path | None = Field(
        None,
        description="JAX compilation cache the learners share, so restarted learners and later "
        "runs of the same model skip compiling; default: $XDG_CACHE_HOME/atoll/compile "
        "(~/.cache/atoll/compile)",
    )
    tape: Path | None = Field(
        None,
        description="write the run's tape here: one JSON line per state change of every "
        "learner, synchronizer and fault (read by `atoll check` and `atoll sim --tape`)",
    )
    redis_url: str = Field(
        "", description="use this Redis instead of starting one (redis://HOST:PORT/DB)"
    )
    report: Path | None = Field(None, description="write the run report JSON here")
    export: Path | None = Field(
        None,
        description="write the final global model here as safetensors, its model config in "
        "the metadata (as `atoll export`; score it with `atoll eval`)",
    )
    plot: Path | None = Field(None, description="write a PNG of the loss curves here")
    workdir: Path | None = Field(
        None,
        description="folder for logs and learner state; default: a temporary one, removed "
        "when the run succeeds unless --keep",
    )
    keep: bool = Field(False, description="keep the temporary --workdir after a successful run")
    speeds: list[float] = Field(
        default_factory=list,
        description="per-learner artificial speed (1 = full; 0.25 = 4x slower); default all 1",
    )
    shared_budget: bool = Field(
        True,
        description="decoupled mode: the learners share learners x --steps as the job's "
        "budget, so a learner a fault slowed is made up for by the others (each may overshoot "
        "by the steps of a heartbeat); off: each runs exactly --steps (equal tokens per "
        "learner, as a quality comparison wants)",
    )
    gpus_per_learner: int = Field(
        0,
        ge=0,
        le=64,
        description="pin learner i to GPUs [i*g, (i+1)*g) through CUDA_VISIBLE_DEVICES (one "
        "learner per GPU: 1); 0: every learner sees every device",
    )
    processes_per_learner: int = Field(
        1,
        ge=1,
        le=64,
        description="processes each learner slot runs as (atoll learner --processes N "
        "--local-processes): one model sharded over all their devices (or replicated, "
        "--param-layout), each process sending and receiving only its own shard; on GPUs one "
        "GPU each (the slot's --gpus-per-learner, by default this many); needs --merge mean",
    )
    batch_sizes: list[int] = Field(
        default_factory=list,
        description="per-learner batch size (sequences per step), e.g. 16,16,16,4; default "
        "all --batch-size",
    )
    tls: bool = Field(
        False,
        description="run the cluster on mTLS: a throwaway CA, a server certificate and one "
        "client certificate per learner slot (in the workdir's tls folder)",
    )
    metrics: bool = Field(
        False,
        description="every learner and replica serves /metrics on a loopback port, listed "
        "in a Prometheus file_sd JSON file (--metrics-targets)",
    )
    metrics_targets: Path | None = Field(
        None,
        description="where --metrics writes the file_sd JSON; default "
        "WORKDIR/prometheus-targets.json",
    )
    live: bool = Field(True, description="show the live view when stdout is a terminal")
    log_every: int = Field(10, ge=1, description="steps between loss points in summaries/plots")
    timeout_s: float = Field(3600.0, gt=0.0, description="stop everything after this long")
    scale: str = Field(
        "",
        description="grow and shrink the job while it runs: 'at=60s,learners=6;at=120s,"
        "learners=3' (times from the first inner step); new slots join and fetch the global "
        "model, the newest slots leave cleanly (SIGTERM, final sync); ',ready=STEPS' holds "
        "an event until every slot has done that many inner steps",
    )
    regions: str = Field(
        "",
        description="run across regions on this machine (needs root): 'us:2,eu:2' puts each "
        "region's learners in a network namespace of its own, joined to a hub namespace "
        "(Redis, the synchronizer replicas) by a link shaped as --link; the region counts "
        "set --learners. Everything the run creates is removed when it ends",
    )
    link: str = Field(
        "rate=100mbit",
        description="with --regions: each region's link to the hub, 'rate=RATE[,delay=DELAY]'; "
        "RATE (bit, kbit, mbit, gbit per second) caps each direction in the kernel (tbf), "
        "DELAY (ms, s) is added one way by atoll's proxy in the hub",
    )
    data_parallel: bool = Field(
        False,
        description="with --regions: the reference a race across regions needs, data-parallel "
        "over the same links: one learner of one process per slot of the regions "
        "(jax.distributed; gloo reduces gradients every step across the links: "
        "--param-layout replicated for classic data-parallel's all-reduce), batch "
        "learners x --batch-size split over them; run as sync mode with one fragment synced "
        "every --eval-every steps (else once, at the end), fp32 both ways, outer lr 1 and no "
        "momentum, the merge's defences against hostile slots off (the identity: the global "
        "model evaluated is the learner's own)",
    )
    hostile: dict[str, Hostility] = Field(
        default_factory=dict,
        description="for the defences' tests and `atoll bench byzantine`, never a real job: "
        'learner slots that attack the job, \'{"learner-3": "x100"}\' (each trains as '
        "usual and corrupts every update it sends: sign-flip, x100, random or replace; "
        "learner/hostile.py)",
    )
    chaos: str = Field(
        "",
        description="faults to inject, 'KIND:key=value,...;...' with KIND learner-kill (mtbf, "
        "down), learner-pause (mtbf, for), synchronizer-kill (mtbf, down), redis-restart "
        "(mtbf), net-latency (mtbf, for, delay), net-bandwidth (mtbf, for, rate), net-reset "
        "(mtbf) or net-partition (mtbf, for); mtbf is cluster-wide, at=20s+40s places faults "
        "at fixed times, victim=N pins the victim; times count from the first inner step; the "
        "schedule follows --seed. Example: 'learner-kill:mtbf=30s,down=5s;net-reset:mtbf=60s'",
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
    slots = {f"learner-{i}" for i in range(settings.learners)}
    unknown = sorted(set(settings.hostile) - slots)
    if unknown:
        return (
            f"--hostile names {', '.join(unknown)}, not a learner slot of this run "
            f"(learner-0 .. learner-{settings.learners - 1})"
        )
    if settings.hostile and settings.processes_per_learner > 1:
        return "--hostile learners run as one process each; drop --processes-per-learner"
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


# The synchronizer's defences against a hostile slot, off: a job of one trusted learner
# has no other slot to defend against, and each of them would make its merge other than the
# identity. With them on, an honest update whose signs happen to disagree with the last
# merged outer gradient's (agreement below 0, common once the loss flattens: consecutive
# outer gradients of one learner are nearly uncorrelated) merged at no weight: the version
# came out equal to the one before, the learner (sync mode) adopted it and lost the steps
# since, and every eval until the next kept update repeated the last one's loss.
IDENTITY_DEFENCES_OFF = {
    "min_update_agreement": -1.0,  # no direction check, and no direction kept
    "max_shrink_agreement": 1.0,  # no shrink check
    # A slot alone on a fragment is clipped to this RMS per value: far above any update.
    "warmup_update_rms": 1e9,
}


def data_parallel(settings: UpSettings) -> UpSettings:
    """--data-parallel: one learner, the regions' slots its processes, the batch of all of
    them, and a merge that is the identity (bench/runs.py's data-parallel reference): outer
    lr 1 without momentum, fp32 both ways, and none of the defences that drop or clip
    an update (`IDENTITY_DEFENCES_OFF`). It syncs every --eval-every steps (else once, at the
    end): what is evaluated is the global model, which through the identity merge is then
    the learner's own parameters at that step."""
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
            **IDENTITY_DEFENCES_OFF,
        }
    )
