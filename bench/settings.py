"""`atoll bench ...`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import CliApp, CliSubCommand

from learner.data import MAX_CORPUS_BYTES
from services.config import AtollSettings


class _Output(BaseModel):
    json_path: Path | None = Field(None, alias="json", description="write the result JSON here")


class SynchronizerBench(_Output):
    """Ingest of 3 learners streaming int8 updates, against raw gRPC streaming of the same
    bytes (on one stream, and one call per update), against a sink that only hashes and sums
    them as an owner must (the floor), and against Redis alone storing them; and the CPU each
    MB cost every part."""

    clients: int = Field(3, ge=1, le=16, description="concurrent learner clients")
    seconds: float = Field(10.0, gt=0.0, description="seconds each measurement streams")
    fragment_mib: float = Field(4.0, gt=0.0, description="encoded int8 update size in MiB")

    def cli_cmd(self) -> None:
        from bench.synchronizer_bench import run

        run(self)


class ScaleBench(_Output):
    """Synchronizer ingest at model size over 1, 2, 4... replicas, rounds merging: MB/s,
    scaling efficiency, peak RSS per replica, Redis memory, merge latency, and how soon
    the learners saw the versions their updates made."""

    params: float = Field(1e9, ge=1e4, description="model parameters N (e.g. 3e8, 1e9)")
    fragments: int = Field(8, ge=1, le=256, description="P")
    replicas: str = Field("1,2,4", description="replica counts to measure, comma separated")
    learners: int = Field(8, ge=1, le=64, description="synthetic learner processes")
    seconds: float = Field(20.0, gt=0.0, description="seconds each replica count streams")
    codec: str = Field("int4", description="codec of the pre-encoded updates")
    calls: int = Field(
        4,
        ge=1,
        le=16,
        description="Ingest calls each synthetic learner keeps in flight, each to a fragment "
        "none of its others is sending, and each fragment sent again once its last update "
        "merged (4: as a learner's client does; a replica holds each arriving update's "
        "payload bytes until it is received)",
    )

    def cli_cmd(self) -> None:
        from bench.scale import run

        run(self)


class ScaleLearner(BaseModel):
    """internal: one synthetic learner of `atoll bench scale`"""

    addresses: str = Field(
        description="synchronizer addresses, comma separated; the session goes to the one at "
        "index mod their count, updates to each fragment's owner"
    )
    index: int = Field(0, description="this learner's number")
    params: int = Field(description="model parameters")
    fragments: int = Field(description="P")
    update: Path = Field(description="the pre-encoded update (packed segments)")
    seconds: float = Field(description="how long to stream")
    result: Path = Field(description="where to write the result JSON")
    codec: str = Field("int4", description="codec the update was encoded with")
    calls: int = Field(1, ge=1, description="Ingest calls in flight at once")

    def cli_cmd(self) -> None:
        from bench.scale import run_learner

        run_learner(self)


class MfuBench(_Output):
    """The learner's training rate (syncing, checkpoints on) against a bare JAX step of the
    same model, per size: MFU, ratio, sync and checkpoint overheads."""

    sizes: str = Field(
        "",
        description="model sizes, comma separated, of 86m, 303m, 1b, cpu-small, cpu-medium "
        "(default: 86m,303m with an NVIDIA GPU, else cpu-small,cpu-medium)",
    )
    steps: int = Field(
        60,
        ge=5,
        description="measured steps per run (after 2 x H + 5 steps: every fragment synced twice)",
    )
    fragments: int = Field(4, ge=1, description="P of the synced runs")
    inner_steps: int = Field(40, ge=1, description="H of the synced runs")
    threads: int = Field(1, ge=1, description="CPU threads of each run (on a CPU)")
    timeout_s: float = Field(900.0, gt=0.0, description="limit for each run")

    def cli_cmd(self) -> None:
        from bench.mfu import run

        run(self)


class MfuAnchor(BaseModel):
    """internal: the bare JAX step `atoll bench mfu` compares against"""

    layers: int = Field(description="layers")
    width: int = Field(description="width")
    heads: int = Field(description="heads")
    context: int = Field(description="context")
    batch_size: int = Field(description="sequences per step")
    steps: int = Field(description="measured steps")
    json_path: Path = Field(alias="json", description="where to write the result")

    def cli_cmd(self) -> None:
        from bench.mfu import run_anchor

        run_anchor(self)


class _Model(BaseModel):
    layers: int = Field(4, ge=1, description="transformer layers")
    width: int = Field(128, ge=8, description="model width")
    heads: int = Field(4, ge=1, description="attention heads")
    context: int = Field(128, ge=8, description="context length in bytes")
    batch_size: int = Field(8, ge=1, description="sequences per step per learner")


class QualityBench(_Model, _Output):
    """Eval loss on the same text: data-parallel, sync DiLoCo (fp32) and decoupled (sweeping
    codec and H), M learners each, every row once per seed; every run's final global model
    scored on held-out files and on --ood-data. `--scale` picks a preset; flags given win."""

    scale: Literal["custom", "gpu", "cpu-smoke"] = Field(
        "custom",
        description="gpu: a 32.3M-parameter model (8 layers, width 576, context 512) for 20 "
        "tokens per parameter (650M tokens per run), M=2, one learner per GPU (data-parallel "
        "spans them all); cpu-smoke: a tiny model for a minute or two on a CPU; custom: the "
        "flags alone",
    )
    learners: int = Field(4, ge=2, le=16, description="M")
    steps: int = Field(150, ge=1, description="inner steps per learner (unless --tokens)")
    tokens: int = Field(
        0,
        ge=0,
        description="tokens each run trains on in all (sets --steps: tokens / (M x batch x "
        "context), rounded up); 0: --steps",
    )
    inner_steps: list[int] = Field([12], description="H values (sync and decoupled runs)")
    fragments: int = Field(3, ge=1, description="P")
    codecs: list[str] = Field(
        ["int8"], description="codecs of the decoupled runs (both directions)"
    )
    runs: list[Literal["dp", "sync", "decoupled", "sanity"]] = Field(
        ["dp", "sync", "decoupled"],
        description="which kinds of run this invocation makes (split a long bench over "
        "several invocations with --baseline); sanity: one learner through the decoupled "
        "path (fp32, outer lr 1, no momentum) against the same learner alone, step by step",
    )
    sanity_steps: int = Field(300, ge=2, description="inner steps of each sanity run")
    baseline: Path | None = Field(
        None,
        description="an earlier result JSON of this bench: its runs join this one's (gaps "
        "are computed over both)",
    )
    lr: float | None = Field(
        None, gt=0.0, description="inner AdamW peak lr of the DiLoCo runs; unset: the learner's"
    )
    dp_lr: float | None = Field(
        None,
        gt=0.0,
        description="inner AdamW peak lr of data-parallel (tune each side: its global batch is "
        "M times a learner's); unset: --lr",
    )
    weight_decay: float = Field(0.01, ge=0.0, description="inner AdamW weight decay, every run")
    warmup_steps: int | None = Field(
        None, ge=0, description="inner warm-up steps; unset: the learner's"
    )
    outer_lr: float | None = Field(None, gt=0.0, description="outer lr; unset: the job's")
    quorum: int | None = Field(
        None, ge=1, description="K of the decoupled runs; unset: the job's (1)"
    )
    outer_momentum: float | None = Field(
        None, ge=0.0, lt=1.0, description="outer Nesterov momentum; unset: the job's"
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="compute dtype (auto: bfloat16 on GPU, float32 on CPU)"
    )
    threads: int = Field(1, ge=1, description="CPU threads of each learner")
    gpus_per_learner: int = Field(
        0, ge=0, description="GPUs of each sync/decoupled learner (1: one per GPU); 0: unpinned"
    )
    data: list[Path] = Field(
        default_factory=list,
        description="training text; empty: this Python's standard library (gpu: with its "
        "site-packages too)",
    )
    eval_data: list[Path] = Field(
        default_factory=list,
        description="evaluation text; empty: every 50th file of --data, held out",
    )
    ood_data: list[Path] = Field(
        default_factory=list,
        description="a second evaluation corpus nobody trained or tuned on (prose, another "
        "project's sources): every run's final model is scored on it too",
    )
    max_corpus_bytes: int = Field(
        MAX_CORPUS_BYTES,
        ge=1 << 10,
        description="training text read, the same first bytes of the files for every run "
        "(the result says when it cut the text)",
    )
    eval_batches: int = Field(16, ge=1, description="eval batches (x batch size sequences)")
    eval_windows: int = Field(
        0, ge=0, description="windows every run is scored on; 0: --eval-batches x --batch-size"
    )
    export_dir: Path | None = Field(
        None,
        description="export each run's final model here (safetensors) and check that "
        "`atoll eval` of it gives the run's eval loss",
    )
    seeds: list[int] = Field(
        [0, 1],
        min_length=1,
        description="initialization and data-order seeds: every row runs once per seed (two "
        "at least, to see the noise a gap must beat)",
    )

    @model_validator(mode="after")
    def _preset(self) -> QualityBench:
        for name, value in QUALITY_PRESETS.get(self.scale, {}).items():
            if name not in self.model_fields_set:
                setattr(self, name, value)
        return self

    def cli_cmd(self) -> None:
        from bench.quality import run

        run(self)


QUALITY_PRESETS: dict[str, dict[str, Any]] = {
    # 32.3M parameters at 20 tokens per parameter (the DiLoCo scaling-law studies' regime):
    # one learner per GPU of a 2-GPU pair, 64 sequences of 512 bytes per learner step, 9,919
    # steps = 650M tokens, about 1.3 passes over the standard library and site-packages.
    "gpu": {
        "layers": 8,
        "width": 576,
        "heads": 9,
        "context": 512,
        "batch_size": 64,
        "learners": 2,
        "tokens": 650_000_000,
        "inner_steps": [100],
        "fragments": 4,
        "codecs": ["int4", "int2"],
        "lr": 2e-3,
        "warmup_steps": 300,
        "threads": 4,
        "gpus_per_learner": 1,
        "eval_windows": 1024,
        "max_corpus_bytes": 1 << 30,
    },
    # The same three kinds of run at a size a test runs in a minute on a CPU.
    "cpu-smoke": {
        "layers": 1,
        "width": 32,
        "heads": 2,
        "context": 32,
        "batch_size": 4,
        "learners": 2,
        "steps": 20,
        "inner_steps": [10],
        "fragments": 2,
        "codecs": ["int4"],
        "eval_windows": 16,
    },
}


class OverlapBench(_Model, _Output):
    """Learner steps/s with syncing on against syncing off (`--standalone`)."""

    batch_size: int = Field(16, ge=1, description="sequences per step (the learner default)")
    steps: int = Field(300, ge=20, description="inner steps of each run")
    inner_steps: int = Field(40, ge=1, description="H (the job default)")
    fragments: int = Field(4, ge=1, description="P")
    codec: str = Field("int8", description="codec of outer gradients")
    threads: int = Field(1, ge=1, description="CPU threads of the learner in both runs")

    def cli_cmd(self) -> None:
        from bench.overlap import run

        run(self)


class GoodputBench(_Model, _Output):
    """Goodput and eval loss of decoupled and sync mode under one seeded fault schedule."""

    batch_size: int = Field(16, ge=1, description="sequences per step per learner")
    learners: int = Field(4, ge=2, le=16, description="M")
    steps: int = Field(200, ge=20, description="inner steps per learner slot (the job's budget)")
    inner_steps: int = Field(40, ge=1, description="H (the job default)")
    fragments: int = Field(4, ge=1, description="P")
    codec: str = Field("int8", description="codec of outer gradients")
    chaos: str = Field(
        "learner-kill:mtbf=30s,down=30s",
        description="the fault SPEC both faulty runs get (a learner takes 30 s to come back, "
        "longer than a fragment's sync interval: on this scale, a node replaced in minutes "
        "at a sync interval of minutes)",
    )
    eval_batches: int = Field(16, ge=1, description="eval batches (x batch size sequences)")
    seed: int = Field(1, description="seed of the fault schedule, the model and the data")

    def cli_cmd(self) -> None:
        from bench.goodput import run

        run(self)


class BandwidthBench(_Model, _Output):
    """Bytes against data-parallel at equal tokens, sweeping the codec and H."""

    learners: int = Field(4, ge=2, le=16, description="M")
    steps: int = Field(300, ge=10, description="inner steps per learner slot")
    fragments: int = Field(4, ge=1, description="P")
    quorum: int = Field(4, ge=1, description="K (rounds of several learners: fewer versions down)")
    inner_steps: list[int] = Field([30, 100], description="H values")
    codecs: list[str] = Field(
        ["fp32", "bf16", "int8", "int4"], description="codecs swept (both directions)"
    )
    eval_batches: int = Field(16, ge=1, description="eval batches (x batch size sequences)")
    seed: int = Field(0, description="initialization and data seed")
    outer_lr: float = Field(0.7, gt=0.0, description="outer learning rate of the decoupled runs")
    outer_momentum: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="outer Nesterov momentum of the decoupled runs (DiLoCo's 0.9 suits "
        "full rounds at large H)",
    )

    def cli_cmd(self) -> None:
        from bench.bandwidth import run

        run(self)


class WanBench(_Model, _Output):
    """A race across regions on this machine (root): data-parallel, decoupled and sync
    DiLoCo over the same shaped links, and decoupled uncapped for `throughput_kept`."""

    regions: str = Field("us:1,eu:1", description="the regions, as atoll up --regions")
    rate: str = Field("100mbit", description="each region link's rate cap (atoll up --link)")
    delay: str = Field("", description="each link's one-way delay, e.g. 40ms (atoll's proxy)")
    steps: int = Field(200, ge=10, description="inner steps per learner slot (same tokens)")
    inner_steps: int = Field(50, ge=1, description="H of the decoupled and sync runs")
    fragments: int = Field(4, ge=1, description="P")
    codec: str = Field("int8", description="codec of outer gradients")
    eval_every: int = Field(20, ge=1, description="steps between evaluations of the global model")
    eval_batches: int = Field(4, ge=1, description="eval batches (x batch size sequences)")
    threads: int = Field(1, ge=1, description="CPU threads of each learner process")
    seed: int = Field(1, description="initialization and data seed")
    tolerance: float = Field(
        0.01, ge=0.0, description="time_to_dp_loss_s counts a loss within this share of dp's"
    )
    runs: list[str] = Field(
        ["dp", "decoupled", "sync", "uncapped"],
        description="which runs, of dp, decoupled, sync and uncapped",
    )
    timeout_s: float = Field(3600.0, gt=0.0, description="each run's limit (atoll up)")
    plot: Path | None = Field(None, description="write a PNG of eval loss against wall time")

    def cli_cmd(self) -> None:
        from bench.wan import run

        run(self)


class HeteroBench(_Model, _Output):
    """M learners with one 4x slower, against all at full speed, same wall clock."""

    batch_size: int = Field(16, ge=1, description="sequences per step per learner")
    learners: int = Field(4, ge=2, le=16, description="M")
    steps: int = Field(200, ge=20, description="inner steps per learner (homogeneous run)")
    slow_speed: float = Field(0.25, gt=0.0, lt=1.0, description="the slow learner's speed")
    inner_steps: int = Field(40, ge=1, description="H")
    fragments: int = Field(4, ge=1, description="P")
    codec: str = Field("int8", description="codec of outer gradients")
    seed: int = Field(0, description="initialization and data seed")

    def cli_cmd(self) -> None:
        from bench.hetero import run

        run(self)


class CodecsBench(_Output):
    """Bytes per value and error of each codec, with and without error feedback."""

    codecs: list[str] = Field(
        ["bf16", "int8", "int4-uniform", "e3m0", "int2", "sign", "topk"],
        description="codecs compared",
    )
    values: int = Field(1 << 18, ge=256, description="values per vector")
    rounds: int = Field(50, ge=1, description="encodings summed with error feedback")
    block_size: int = Field(256, ge=1, description="values per block scale")
    seed: int = Field(0, description="random seed")

    def cli_cmd(self) -> None:
        from bench.codecs import run

        run(self)


class CodecSpeedBench(_Output):
    """Encode and decode speed of each codec on one host core (beside the least memory
    traffic decoding into a sum has), and int8 and int4 encoding on the learner's device
    against the host path, side by side in one run."""

    codecs: list[str] = Field(
        ["fp32", "bf16", "int8", "int4", "e3m0", "int2", "sign", "topk"],
        description="codecs measured (int4: the codec `--codec int4` names)",
    )
    values: int = Field(
        25_000_000,
        ge=256,
        description="values encoded (default: a fragment of a 100M-parameter model at P=4)",
    )
    block_size: int = Field(256, ge=1, description="values per block scale")
    chunk_bytes: int = Field(1 << 20, ge=1024, description="encoded bytes a segment, at most")
    repeats: int = Field(3, ge=1, description="runs of each measurement (the best is kept)")
    device: bool = Field(True, description="also measure encoding on JAX's device")
    tensors: int = Field(8, ge=1, description="tensors in the device run's fragment")
    seed: int = Field(0, description="random seed")

    def cli_cmd(self) -> None:
        from bench.codec_speed import run

        run(self)


class RawSink(BaseModel):
    """Internal: the bare gRPC sink that `bench synchronizer` measures against."""

    port_file: Path = Field(description="write the bound port here (JSON)")
    summing: bool = Field(
        False,
        description="also hash each chunk and sum it into a float32 fragment on one worker "
        "thread, as a fragment's owner must (the floor of `bench synchronizer`)",
    )

    def cli_cmd(self) -> None:
        from bench.synchronizer_bench import serve_raw_sink

        serve_raw_sink(self.port_file, summing=self.summing)


class BenchCommand(AtollSettings):
    """Benchmarks; each writes its figures as JSON with --json PATH."""

    synchronizer: CliSubCommand[SynchronizerBench] = Field(
        description="synchronizer ingest against raw gRPC streaming of the same bytes"
    )
    quality: CliSubCommand[QualityBench] = Field(
        description="eval loss at equal tokens: data-parallel, sync and decoupled"
    )
    overlap: CliSubCommand[OverlapBench] = Field(
        description="learner steps/s with syncing on against syncing off"
    )
    bandwidth: CliSubCommand[BandwidthBench] = Field(
        description="bytes against data-parallel at equal tokens, sweeping codec and H"
    )
    wan: CliSubCommand[WanBench] = Field(
        description="across regions on this machine (root): data-parallel, decoupled and "
        "sync over the same shaped links"
    )
    hetero: CliSubCommand[HeteroBench] = Field(
        description="one learner 4x slower against all at full speed, same wall clock"
    )
    codecs: CliSubCommand[CodecsBench] = Field(
        description="bytes per value and error of each codec, with error feedback"
    )
    codec_speed: CliSubCommand[CodecSpeedBench] = Field(
        description="encode and decode GB/s of each codec on a core, and encode ms on the device"
    )
    goodput: CliSubCommand[GoodputBench] = Field(
        description="goodput of decoupled against sync mode under the same seeded faults"
    )
    scale: CliSubCommand[ScaleBench] = Field(
        description="synchronizer ingest at model size over several replicas, rounds merging"
    )
    mfu: CliSubCommand[MfuBench] = Field(
        description="the learner's step against a bare JAX step: MFU and overheads"
    )
    raw_sink: CliSubCommand[RawSink] = Field(description="internal: raw gRPC sink")
    mfu_anchor: CliSubCommand[MfuAnchor] = Field(description="internal: the bare JAX step")
    scale_learner: CliSubCommand[ScaleLearner] = Field(
        description="internal: a synthetic learner of `atoll bench scale`"
    )

    def cli_cmd(self) -> None:
        # SIGTERM (a timeout, a stopped job) ends a bench as Ctrl-C does: its temporary
        # folders (at 1e9, tens of GB of tensor store) are removed and its children stopped.
        signal.signal(signal.SIGTERM, _exit_on_signal)
        try:
            CliApp.run_subcommand(self)
        finally:
            if _SIGNALLED:
                # Everything is cleaned up once the exit has unwound to here. What is left is
                # the interpreter's teardown, where a gRPC channel the signal cut off mid-call
                # can wait forever in its destructor: the process ends without it.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(128 + _SIGNALLED[0])


_SIGNALLED: list[int] = []  # the signal that stopped the bench, once one has


def _exit_on_signal(signum: int, _: FrameType | None) -> None:
    _SIGNALLED.append(signum)
    raise SystemExit(128 + signum)


# Every benchmark a user can run, as `atoll --help` lists them.
BENCHMARKS = tuple(
    name.replace("_", "-")
    for name, field in BenchCommand.model_fields.items()
    if not (field.description or "").startswith("internal")
)
