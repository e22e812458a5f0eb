"""Errors a user can cause on the command line: one line that says what was wrong and what to
do, naming the flag; nothing left behind."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.processes import atoll_command


@pytest.fixture
def taken() -> Iterator[str]:
    """A loopback address some other process listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield f"127.0.0.1:{holder.getsockname()[1]}"


def synchronizer(*flags: str) -> subprocess.CompletedProcess[str]:
    """A replica on loopback, its Redis a port nothing answers on."""
    args = {
        "--listen": "127.0.0.1:0",
        "--metrics-listen": "127.0.0.1:0",
        "--redis-url": "redis://127.0.0.1:1/0",
    }
    args.update(zip(flags[::2], flags[1::2], strict=True))
    command = atoll_command("synchronizer", "--insecure", *(x for kv in args.items() for x in kv))
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flag", ["--listen", "--metrics-listen"])
def test_a_port_in_use_is_one_line_naming_its_flag(taken: str, flag: str) -> None:
    done = synchronizer(flag, taken)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"atoll synchronizer: cannot listen on {flag} {taken}: address already in use; "
        "choose a free port, or stop the process that holds it"
    ]


def test_redis_is_blamed_only_when_it_is_redis() -> None:
    done = synchronizer()
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "atoll synchronizer: cannot reach Redis at redis://127.0.0.1:1/0 (ConnectionError); "
        "start it or fix --redis-url"
    ]


def test_a_refused_chaos_spec_leaves_no_folder(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    done = subprocess.run(
        atoll_command("up", "--chaos", "lerner-kill:at=5s", "--no-live"),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("atoll up: "), line
    assert "lerner-kill" in line, line
    assert not list(temp.iterdir())
