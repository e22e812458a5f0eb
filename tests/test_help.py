"""`--help` reads as a user's manual: every benchmark listed, no pydantic type labels."""

from __future__ import annotations

import pytest

from atoll.cli import main
from bench.settings import BENCHMARKS


def help_of(capsys: pytest.CaptureFixture[str], *command: str) -> str:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return capsys.readouterr().out


def test_atoll_help_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(help_of(capsys).split())
    assert len(BENCHMARKS) >= 7
    for name in BENCHMARKS:
        assert name in text


@pytest.mark.parametrize("command", ["up", "learner", "synchronizer", "sim"])
def test_help_shows_no_pydantic_labels(capsys: pytest.CaptureFixture[str], command: str) -> None:
    text = help_of(capsys, command)
    for label in ("null", "list[", "default factory", "{Path"):
        assert label not in text, label
