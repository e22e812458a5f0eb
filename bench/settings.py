"""`atoll bench ...`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field
from pydantic_settings import CliApp, CliSubCommand

from services.config import AtollSettings


class _Output(BaseModel):
    json_path: Path | None = Field(None, alias="json", description="write the result JSON here")


class SynchronizerBench(_Output):
    """Ingest of 3 learners streaming int8 updates, against raw gRPC streaming of the same bytes."""

    clients: int = Field(3, ge=1, le=16, description="concurrent learner clients")
    seconds: float = Field(10.0, gt=0.0, description="seconds each measurement streams")
    fragment_mib: float = Field(4.0, gt=0.0, description="encoded int8 update size in MiB")

    def cli_cmd(self) -> None:
        from bench.synchronizer_bench import run

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
    raw_sink: CliSubCommand[RawSink] = Field(description="internal: raw gRPC sink")

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)
