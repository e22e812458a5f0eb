"""`atoll bench ...`: benchmarks that print ratios measured side by side in one run.

Each benchmark's module owns its flags (a settings class whose `cli_cmd` runs it); this
module only gathers them into the `atoll bench` command."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

from pydantic import Field
from pydantic_settings import CliApp, CliSubCommand

from bench.bandwidth import BandwidthBench
from bench.byzantine import ByzantineBench
from bench.codec_speed import CodecSpeedBench
from bench.codecs import CodecsBench
from bench.goodput import GoodputBench
from bench.hetero import HeteroBench
from bench.mfu import MfuAnchor, MfuBench
from bench.overlap import OverlapBench
from bench.quality import QualityBench
from bench.raw_sink import RawSink
from bench.scale import ScaleBench
from bench.synchronizer_bench import SynchronizerBench
from bench.synthetic import ScaleLearner
from bench.wan import WanBench
from services.config import AtollSettings


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
    byzantine: CliSubCommand[ByzantineBench] = Field(
        description="the final eval loss with one hostile learner of M, and a colluding pair, "
        "against the all-honest run of the same seeds"
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
