"""`atoll --version` prints the installed package's version."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from atoll.cli import main


def test_version_is_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--version"])
    assert capsys.readouterr().out == f"atoll {version('atoll')}\n"
