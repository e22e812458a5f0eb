"""`atoll bench ...`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field
from pydantic_settings import CliApp, CliSubCommand

from services.config import AtollSettings


class _Output(BaseModel):
    json_path: Path | None = Field(None, alias="json", description="write the result JSON here")


class SynchronizerBench(_Output):
    """Ingest of 3 learners streaming int8 updates, against raw gRPC streaming of the same
    bytes and against Redis alone storing them."""

    clients: int = Field(3, ge=1, le=16, description="concurrent learner clients")
    seconds: float = Field(10.0, gt=0.0, description="seconds each measurement streams")
    fragment_mib: float = Field(4.0, gt=0.0, description="encoded int8 update size in MiB")

    def cli_cmd(self) -> None:
        from bench.synchronizer_bench import run

        run(self)


class _Model(BaseModel):
    layers: int = Field(4, ge=1, description="transformer layers")
    width: int = Field(128, ge=8, description="model width")
    heads: int = Field(4, ge=1, description="attention heads")
    context: int = Field(128, ge=8, description="context length in bytes")
    batch_size: int = Field(8, ge=1, description="sequences per step per learner")


class QualityBench(_Model, _Output):
    """Eval loss at equal tokens: data-parallel, sync DiLoCo and decoupled, M learners each."""

    learners: int = Field(4, ge=2, le=16, description="M")
    steps: int = Field(150, ge=10, description="inner steps per learner")
    inner_steps: int = Field(12, ge=1, description="H")
    fragments: int = Field(3, ge=1, description="P")
    codec: str = Field("int8", description="codec of outer gradients")
    eval_batches: int = Field(16, ge=1, description="eval batches (x batch size sequences)")
    seed: int = Field(0, description="initialization and data seed")

    def cli_cmd(self) -> None:
        from bench.quality import run

        run(self)


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
    speed_values: int = Field(
        25_000_000,
        ge=0,
        description="values in the vector each codec encodes and decodes for its speed (one "
        "core); 0: no speed runs",
    )
    speed_repeats: int = Field(3, ge=1, description="speed runs per codec (the best is kept)")

    def cli_cmd(self) -> None:
        from bench.codecs import run

        run(self)


class RawSink(BaseModel):
    """Internal: the bare gRPC sink that `bench synchronizer` measures against."""

    port_file: Path = Field(description="write the bound port here (JSON)")

    def cli_cmd(self) -> None:
        from bench.synchronizer_bench import serve_raw_sink

        serve_raw_sink(self.port_file)


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
    hetero: CliSubCommand[HeteroBench] = Field(
        description="one learner 4x slower against all at full speed, same wall clock"
    )
    codecs: CliSubCommand[CodecsBench] = Field(
        description="bytes per value and error of each codec, with error feedback"
    )
    goodput: CliSubCommand[GoodputBench] = Field(
        description="goodput of decoupled against sync mode under the same seeded faults"
    )
    raw_sink: CliSubCommand[RawSink] = Field(description="internal: raw gRPC sink")

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


# Every benchmark a user can run, as `atoll --help` lists them.
BENCHMARKS = tuple(
    name.replace("_", "-")
    for name, field in BenchCommand.model_fields.items()
    if not (field.description or "").startswith("internal")
)
