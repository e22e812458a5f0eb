import os
import platform
import subprocess
import sys
import time

from services.lifecycle import PARENT_ENV, reuse_large_buffers


def test_large_buffers_setting_takes_on_glibc() -> None:
    # mallopt answers 1 for a value it accepts; off glibc nothing is changed.
    assert reuse_large_buffers() is (platform.libc_ver()[0] == "glibc")


def test_an_orphan_that_ignores_sigterm_ends_after_its_grace() -> None:
    """A child whose atoll parent died is sent SIGTERM; one that does not stop for it (a
    learner waiting on its final sync) ends once the grace period has passed."""
    child_code = (
        "import signal, time\n"
        "from services.lifecycle import watch_parent\n"
        "signal.signal(signal.SIGTERM, lambda *_: print('sigterm', flush=True))\n"
        "watch_parent(0.05, grace_s=0.5)\n"
        "time.sleep(60)\n"
    )
    parent_code = (
        "import os, subprocess, sys\n"
        f"env = dict(os.environ, {PARENT_ENV}=str(os.getpid()))\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}], env=env)\n"
        "print(child.pid, flush=True)\n"
    )
    parent = subprocess.run(
        [sys.executable, "-c", parent_code], capture_output=True, text=True, check=True
    )
    pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), "the orphan is still running"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as ended.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
