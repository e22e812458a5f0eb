"""Settings of `atoll learner` (and of the model and data, shared with `atoll up`)."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from learner.data import MAX_CORPUS_BYTES, DataSplit
from learner.hostile import Hostility
from services.config import AtollSettings

# How a learner over several devices holds its parameters and inner optimizer state
# (learner/mesh.py): split over the devices, or whole on each.
ParamLayout = Literal["sharded", "replicated"]


class ModelConfig(BaseModel):
    """The built-in byte-level transformer, its optimizer and its data."""

    model: str = Field(
        "builtin",
        description="'builtin' (byte-level transformer sized by the flags below) or "
        "'module:function' returning (params, loss_fn) for your own model",
    )
    layers: int = Field(4, ge=1, le=128, description="transformer layers")
    width: int = Field(128, ge=8, le=16384, description="model width (d_model)")
    heads: int = Field(4, ge=1, le=256, description="attention heads (must divide width)")
    context: int = Field(128, ge=8, le=65536, description="context length in bytes")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="compute dtype of matmuls and attention; parameters and optimizer state "
        "stay float32. auto: bfloat16 on GPU and TPU, float32 on CPU",
    )
    batch_size: int = Field(16, ge=1, description="sequences per inner step (whole learner)")
    lr: float = Field(3e-3, gt=0.0, description="inner AdamW peak learning rate")
    warmup_steps: int = Field(20, ge=0, description="inner learning-rate warm-up steps")
    weight_decay: float = Field(0.01, ge=0.0, description="inner AdamW weight decay")
    clip_norm: float = Field(
        1.0,
        ge=0.0,
        description="clip each inner step's gradient to this global L2 norm before AdamW "
        "(0: no clipping); applies to every mode, data-parallel included",
    )
    seed: int = Field(0, description="initialization and data-order seed")
    data: list[Path] = Field(
        default_factory=list,
        description="text files or folders to train on; empty: this Python's standard library "
        "sources",
    )
    eval_data: list[Path] = Field(
        default_factory=list,
        description="text files or folders to evaluate on (never trained on); empty: every "
        "50th file of --data is held out",
    )
    data_split: DataSplit = Field(
        "files",
        description="how learners share the training text. files: each reads its own files "
        "(every --num-shards-th; what pods of a pool reading a large corpus do); windows: "
        "each reads all of it and trains on its part of one global batch of one token stream "
        "(M learners' step k holds the windows data-parallel's step k does: what a fair "
        "quality comparison needs)",
    )
    max_corpus_bytes: int = Field(
        MAX_CORPUS_BYTES,
        ge=1 << 10,
        description="read at most about this many bytes of training text per learner, in file "
        "order (the learner's summary says whether it cut any)",
    )
    eval_fraction: float = Field(
        0.02, gt=0.0, lt=0.5, description="share of the text held out for evaluation"
    )
    threads: int = Field(1, ge=1, le=256, description="CPU threads for JAX/XLA in this learner")
    param_layout: ParamLayout = Field(
        "sharded",
        description="how a learner over several devices (--processes, or one process's GPUs) "
        "holds its parameters and inner optimizer state. sharded: split over the devices "
        "(FSDP); each step gathers the parameters for the forward and backward passes and "
        "reduce-scatters the gradients, which between two processes on CPUs moved 1.8x "
        "(119k parameters) to 3.6x (6.1M) the model's float32 size each way per step. "
        "replicated: whole on every device; each step all-reduces the gradients, about 1x "
        "each way between two processes (1.2x measured, TCP included), and every process "
        "fetches whole fragments, the first alone sending them",
    )
    eval_every: int = Field(
        50,
        ge=0,
        description="steps between evals of the global model; 0 off (atoll up: the learners "
        "take turns, so the cluster evaluates about this often, not each learner)",
    )
    eval_batches: int = Field(4, ge=1, description="batches per eval")
    eval_windows: int = Field(
        0,
        ge=0,
        description="windows of context bytes scored per eval, evenly spread over the "
        "evaluation text (the selection `atoll eval --windows` makes); 0: --eval-batches x "
        "--batch-size",
    )


class LearnerSettings(ModelConfig, AtollSettings):
    """`atoll learner`: one island of compute."""

    synchronizer: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:50051"],
        description="synchronizer addresses HOST:PORT (repeat or comma-separate); tried in turn; "
        "default 127.0.0.1:50051",
    )
    route: list[str] = Field(
        default_factory=list,
        description="ADVERTISED=REACHABLE (repeat or comma-separate): reach a replica that "
        "advertises HOST:PORT at another HOST:PORT (a proxy, a NAT, a port forward)",
    )
    id: str = Field(
        default_factory=socket.gethostname,
        description="stable learner slot name; default: this host's name",
    )
    job: str = Field("default", description="job to join (must match the synchronizer's)")
    token: str = Field(
        "", description="this slot's token (or the job's shared one), sent as a bearer token"
    )
    insecure: bool = Field(
        False, description="plaintext gRPC (no TLS); only on loopback or a trusted network"
    )
    tls_ca: Path | None = Field(
        None, description="PEM CA the synchronizers' certificates chain to (TLS)"
    )
    tls_cert: Path | None = Field(
        None, description="PEM client certificate of this learner slot (mTLS)"
    )
    tls_key: Path | None = Field(None, description="PEM private key of --tls-cert")
    tls_server_name: str = Field(
        "",
        description="the name every replica's certificate is checked against when this learner "
        "sends to it at the address it advertises (replicas share one certificate naming "
        "their Service, and advertise their pod IP); default: the host of the first "
        "--synchronizer address",
    )
    steps: int = Field(0, ge=0, description="inner steps to run, then leave; 0: run until stopped")
    shard: int = Field(0, ge=0, description="this learner's data shard index")
    num_shards: int = Field(1, ge=1, description="number of data shards")
    ordinal_shard: bool = Field(
        False,
        description="add the number at the end of --id (a StatefulSet pod's ordinal) to "
        "--shard, so every learner of a pool reads its own shard",
    )
    state_dir: Path | None = Field(
        None,
        description="folder keeping this slot's local checkpoint and read position, so a "
        "restarted learner resumes its work and its shard",
    )
    checkpoint_every: int = Field(
        1,
        ge=0,
        description="steps between local checkpoints in --state-dir (parameters, optimizer "
        "state, outer bookkeeping), written off the inner loop; one still being written when "
        "the next is due is skipped; 0: none, a restart resumes only its place in the data",
    )
    checkpoint_seconds: float = Field(
        1.0,
        ge=0.0,
        description="at least this long between two local checkpoints, so fast steps do not "
        "spend their time writing them (a restart loses at most about this much work)",
    )
    eval_offset: int = Field(
        0,
        ge=0,
        description="evaluate at the steps where step modulo --eval-every equals this, so the "
        "learners of a job can take turns evaluating the same global model",
    )
    speed: float = Field(
        1.0, gt=0.0, le=1.0, description="artificial slowdown: 0.25 makes steps 4x slower"
    )
    heartbeat_s: float = Field(1.0, gt=0.0, description="seconds between heartbeats")
    metrics_listen: str = Field("", description="HOST:PORT for /metrics; empty: none")
    export_provisioned: bool = Field(
        True,
        description="export this process's atoll_provisioned_seconds_total; `atoll up "
        "--metrics` turns it off and exports each slot's time itself, dead time included",
    )
    max_backoff_s: float = Field(5.0, gt=0.0, description="cap of the reconnect backoff")
    give_up_s: float = Field(
        0.0,
        ge=0.0,
        description="exit (status 1) once no synchronizer has answered for this many seconds, "
        "at start or later; 0 (the default): never give up on the synchronizer tier: keep "
        "training from what this learner holds and retry with backoff for as long as it lives",
    )
    report: Path | None = Field(None, description="write this learner's summary JSON here")
    log_every: int = Field(10, ge=1, description="steps between loss points in the summary")
    rate_after_steps: int = Field(
        5,
        ge=0,
        description="steps before the report's steady training rate is measured (what "
        "compiles on the first steps and syncs stays out of it)",
    )
    standalone: bool = Field(
        False, description="train without a synchronizer (the baseline of `bench overlap`)"
    )
    hostile: Hostility | None = Field(
        None,
        description="for the defences' tests and `atoll bench byzantine`, never a real job: "
        "train as usual and corrupt every update sent (sign-flip, x100, random: noise of the "
        "update's norm, replace: 0.99 times the fragment; learner/hostile.py)",
    )
    linger_s: float = Field(
        0.0,
        ge=0.0,
        description="after the last step and final sync, keep taking new global "
        "values this long (or until SIGTERM), so the learner ends on the final global model",
    )
    log_level: str = Field("info", description="debug, info, warning or error")
    tape: Path | None = Field(
        None, description="append this learner's state changes (JSON lines) to this tape file"
    )
    lr_horizon_steps: int = Field(
        0, ge=0, description="steps over which the learning rate decays; 0: --steps"
    )
    processes: int = Field(
        1,
        ge=1,
        le=4096,
        description="processes (hosts, or GPUs) this one learner spans through jax.distributed: "
        "parameters and optimizer state sharded over all their devices (or replicated, "
        "--param-layout), each process sending and receiving only its own shard of each "
        "fragment (the job needs --merge mean)",
    )
    process_id: int | None = Field(
        None,
        ge=0,
        description="this process's index among --processes (0 keeps the learner's session); "
        "unset: from the cluster (SLURM, Open MPI, a TPU slice), or 0 with --local-processes",
    )
    coordinator: str = Field(
        "",
        description="HOST:PORT of process 0's coordination service, the same for every "
        "process; empty: from the cluster, or a free local port with --local-processes",
    )
    collectives_host: str = Field(
        "",
        description="the address this process's CPU collectives (gloo) listen on and give the "
        "other processes; default: what this host's name resolves to (set it where that "
        "address is not this process's, e.g. in a network namespace)",
    )
    local_processes: bool = Field(
        False,
        description="start the other --processes - 1 processes on this machine, each on one "
        "of the GPUs it sees (on CPU, each with its own device)",
    )
    compile_cache: Path | None = Field(
        None,
        description="folder for JAX's persistent compilation cache: a restarted learner loads "
        "its compiled step from here instead of compiling again",
    )

    @model_validator(mode="after")
    def _one_process_if_hostile(self) -> LearnerSettings:
        if self.hostile is not None and self.processes > 1:
            raise ValueError("--hostile corrupts a learner of one process; drop --processes")
        return self


def data_shard(settings: LearnerSettings) -> int:
    """The shard this learner reads: --shard, plus its id's ordinal with --ordinal-shard."""
    if not settings.ordinal_shard:
        return settings.shard
    match = re.search(r"(\d+)$", settings.id)
    if match is None:
        raise ValueError(
            f"--ordinal-shard needs an --id ending in a number (a StatefulSet pod name), "
            f"not {settings.id!r}"
        )
    shard = settings.shard + int(match.group(1))
    if shard >= settings.num_shards:
        raise ValueError(
            f"--shard {settings.shard} + ordinal {match.group(1)} is past --num-shards "
            f"{settings.num_shards}; raise --num-shards or lower the pool's replicas"
        )
    return shard
