"""A Redis this process started ends with it, also when it is killed outright; and it is
started without Python code between fork and exec (gRPC's threads make that unsafe)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cluster.redis_server import RedisServer

STARTER = """
import sys, time
from pathlib import Path
from cluster.redis_server import RedisServer
server = RedisServer(Path(sys.argv[1])).start()
assert server.process is not None
print(server.process.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its new parent) counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_redis_server_stops_when_the_process_that_started_it_is_killed(tmp_path: Path) -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path / "redis")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert starter.stdout is not None
    pid = int(starter.stdout.readline())
    assert _alive(pid)
    assert "redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    starter.send_signal(signal.SIGKILL)
    starter.wait(10)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "redis-server outlived the process that started it"


def test_a_redis_server_started_here_is_the_pid_stopped_here(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as server:
        assert server.process is not None
        pid = server.process.pid
        # The interpreter that started it became it (exec): the PID stopped is Redis's.
        assert "redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    assert not _alive(pid)
