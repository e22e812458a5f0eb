"""`atoll`: one command for the services and for the tools that run the system as a whole.

Every flag also reads from `ATOLL_<FLAG>` and from the TOML file named by `ATOLL_CONFIG`.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, CliApp, CliSubCommand, SettingsConfigDict

from bench.settings import BENCHMARKS, BenchCommand
from cluster.check import CheckSettings
from cluster.evaluate import EvalSettings
from cluster.export import ExportSettings
from cluster.settings import UpSettings
from learner.settings import LearnerSettings
from services.config import CLI_HELP, HelpFormat, SynchronizerSettings
from services.lifecycle import limit_heap_arenas, reuse_large_buffers, watch_parent
from sim.plan import PlanSettings
from sim.settings import SimSettings


class SynchronizerCommand(SynchronizerSettings):
    """Run one synchronizer replica (stateless: state in Redis and the tensor store)."""

    def cli_cmd(self) -> None:
        from synchronizer.server import run

        limit_heap_arenas()  # before the replica's threads: what a request flood frees goes back
        run(self)


class LearnerCommand(LearnerSettings):
    """Run one learner: a JAX inner loop that syncs fragments with the synchronizer."""

    def cli_cmd(self) -> None:
        from learner.main import run

        run(self)


class UpCommand(UpSettings):
    """Start a local cluster: Redis, synchronizer replicas and learners, with a live view."""

    def cli_cmd(self) -> None:
        from cluster.up import run

        raise SystemExit(run(self))


class CheckCommand(CheckSettings):
    """Check a run's invariants and compute its goodput from its tape."""

    def cli_cmd(self) -> None:
        from cluster.check import run

        raise SystemExit(run(self))


class ExportCommand(ExportSettings):
    """Write a job's global model (running or finished) as one safetensors file."""

    def cli_cmd(self) -> None:
        from cluster.export import run

        raise SystemExit(run(self))


class EvalCommand(EvalSettings):
    """Eval loss (nats per byte) of an exported model on any text files or folders."""

    def cli_cmd(self) -> None:
        from cluster.evaluate import run

        raise SystemExit(run(self))


class SimCommand(SimSettings):
    """Goodput at datacenter scale (discrete-event simulation), or a run's tape replayed."""

    def cli_cmd(self) -> None:
        from sim.main import run

        raise SystemExit(run(self))


class PlanCommand(PlanSettings):
    """WAN bandwidth a run needs for a target compute utilization: data-parallel and atoll."""

    def cli_cmd(self) -> None:
        from sim.plan import run

        raise SystemExit(run(self))


class Atoll(BaseSettings):
    """atoll: resilient, low-bandwidth distributed training (Decoupled DiLoCo); --version."""

    model_config = SettingsConfigDict(
        **CLI_HELP, cli_kebab_case=True, cli_prog_name="atoll", cli_implicit_flags=True
    )

    synchronizer: CliSubCommand[SynchronizerCommand] = Field(
        description="run one synchronizer replica (stateless: state in Redis and the tensor store)"
    )
    learner: CliSubCommand[LearnerCommand] = Field(
        description="run one learner: a JAX inner loop syncing fragments"
    )
    up: CliSubCommand[UpCommand] = Field(
        description="a local cluster: Redis, synchronizers, learners, live view, report"
    )
    check: CliSubCommand[CheckCommand] = Field(
        description="a run's invariants and goodput from its tape (atoll up --tape)"
    )
    export: CliSubCommand[ExportCommand] = Field(
        description="a job's global model as one safetensors file, its config in the metadata"
    )
    eval: CliSubCommand[EvalCommand] = Field(
        description="eval loss of an exported model on any text files, deterministic"
    )
    sim: CliSubCommand[SimCommand] = Field(
        description="goodput at scale by simulation: --table, --plot, or --tape replay"
    )
    plan: CliSubCommand[PlanCommand] = Field(
        description="WAN bandwidth for a target utilization, data-parallel against atoll"
    )
    bench: CliSubCommand[BenchCommand] = Field(description="benchmarks: " + ", ".join(BENCHMARKS))

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--version"]:
        try:
            print(f"atoll {version('atoll')}")
        except PackageNotFoundError:
            print("atoll: no version: not installed (pip install -e .)", file=sys.stderr)
            raise SystemExit(1) from None
        return
    watch_parent()
    reuse_large_buffers()
    try:
        CliApp.run(Atoll, cli_args=args, cli_settings_source=HelpFormat(Atoll))
    except ValidationError as err:
        for problem in err.errors():
            flag = "--" + "-".join(str(p) for p in problem["loc"][-1:]).replace("_", "-")
            print(f"atoll: {flag}: {problem['msg']}", file=sys.stderr)
        print("atoll: see --help for each flag's meaning and range", file=sys.stderr)
        raise SystemExit(2) from None
    except (FileNotFoundError, ValueError) as err:
        print(f"atoll: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
