"""`--help` reads as a user's manual: every benchmark listed, no pydantic type labels, and
no default shown where there is none (a flag that is unset says in its description what
happens then)."""

from __future__ import annotations

import pytest

from atoll.cli import Atoll, main
from bench.settings import BENCHMARKS, BenchCommand

COMMANDS = (
    [()]
    + [(name.replace("_", "-"),) for name in Atoll.model_fields if name != "bench"]
    + [("bench", name.replace("_", "-")) for name in BenchCommand.model_fields]
)
# What argparse would print for a pydantic type, a list default or a default that means
# "unset".
UNREADABLE = (
    "null",
    "list[",
    "default factory",
    "{Path",
    "(default: None)",
    "(default: )",
    "(default: False)",
    "(default: [",  # a list as Python writes it; the flag takes a,b
    "(default: none)",
)


def help_of(capsys: pytest.CaptureFixture[str], *command: str) -> str:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return capsys.readouterr().out


def test_atoll_help_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(help_of(capsys).split())
    assert len(BENCHMARKS) >= 7
    for name in BENCHMARKS:
        assert name in text


def test_every_subcommand_is_checked() -> None:
    assert len(COMMANDS) >= 1 + 8 + len(BENCHMARKS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: " ".join(command) or "atoll")
def test_help_reads_plainly(capsys: pytest.CaptureFixture[str], command: tuple[str, ...]) -> None:
    # Joined over argparse's line wrapping, so a label split across two lines is still seen.
    text = " ".join(help_of(capsys, *command).split())
    for label in UNREADABLE:
        assert label not in text, f"atoll {' '.join(command)} --help shows {label!r}"
    assert "--help" in text


def test_a_real_default_is_still_shown(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(help_of(capsys, "up").split())
    assert "learner processes (M) (default: 3)" in text
    assert "(default: True)" in text  # a flag on unless --no-... is given
