"""A child of an atoll process ends when its parent does.

`atoll up` and the benchmarks start their children in new sessions (so a signal aimed at one
child reaches only it) and put their own PID in `ATOLL_PARENT_PID`. If that parent dies
without stopping them (SIGKILL, a crash), the children notice they were re-parented and
stop themselves with SIGTERM, so nothing is left running.
"""

from __future__ import annotations

import os
import signal
import threading
import time

PARENT_ENV = "ATOLL_PARENT_PID"


def watch_parent(interval_s: float = 1.0) -> None:
    """If started by an atoll parent, SIGTERM this process once that parent is gone."""
    expected = os.environ.get(PARENT_ENV)
    if not expected:
        return
    parent = int(expected)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="atoll-parent-watch", daemon=True).start()
