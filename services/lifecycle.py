"""What every atoll process sets up first: it ends when its atoll parent does, and it
reuses the MiB-sized buffers payloads travel in (`reuse_large_buffers`).

`atoll up` and the benchmarks start their children in new sessions (so a signal aimed at one
child reaches only it) and put their own PID in `ATOLL_PARENT_PID`. If that parent dies
without stopping them (SIGKILL, a crash), the children notice they were re-parented and
stop themselves with SIGTERM, and end regardless once a grace period has passed (an orphaned
learner's final sync would otherwise wait for synchronizers that are gone), so nothing is
left running: on a GPU, nothing left holding its memory.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

PARENT_ENV = "ATOLL_PARENT_PID"


# How long an orphan's orderly stop may take before it ends regardless: a learner's final
# sync waits for a synchronizer tier that, when their parent died, went with it.
ORPHAN_GRACE_S = 30.0


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (what `taskset`, a container's
    cpuset or a benchmark's pinning allows), not every core of the machine. Thread pools sized
    by the machine's count oversubscribe a replica pinned to a share of it: on 16 cores, eight
    replicas each with sixteen summing threads made the slowest merges wait on each other."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity call on this platform
        return os.cpu_count() or 1


def watch_parent(
    interval_s: float = 1.0, grace_s: float = ORPHAN_GRACE_S, parent: int | None = None
) -> None:
    """If started by an atoll parent (`parent`, else the one ATOLL_PARENT_PID names), SIGTERM
    this process once that parent is gone, and end it `grace_s` later if it still runs."""
    if parent is None:
        expected = os.environ.get(PARENT_ENV)
        if not expected:
            return
        parent = int(expected)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="atoll-parent-watch", daemon=True).start()


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
SERVICE_ARENAS = 1
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value
TRIM_THRESHOLD_BYTES = 512 << 20


def give_back_free_memory() -> bool:
    """Return the heap's free memory to the system now (glibc's malloc_trim): what
    `reuse_large_buffers` keeps for reuse, where a burst of work nobody should pay for (a
    flood of unauthenticated requests) left it. False off glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


def reuse_large_buffers() -> bool:
    """Keep MiB-sized buffers on the heap, and freed heap memory for reuse (glibc only).

    Every update chunk, message and reassembled payload an atoll process handles is a buffer
    of about a MiB. By default glibc maps such buffers fresh and unmaps them when freed (and
    trims the heap soon after), so each one's pages fault in again: measured on this
    project's development VM, serializing a 4 MiB update took 16 ms that way and 4 ms with
    the buffers reused. Returns whether the setting took (False off glibc, where nothing
    changes).
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def limit_heap_arenas(arenas: int = SERVICE_ARENAS) -> bool:
    """Cap glibc's heap arenas (its default is eight per core, one for each thread that
    allocates while another holds an arena). A service's many gRPC threads each kept an arena
    of their own, and what a flood of requests freed there stayed, fragmented past what
    `malloc_trim` gives back: after 520 MiB of unauthenticated requests a replica stayed 54-115
    MB larger with the default, 14-33 MB with four or two arenas (up to 66 MB on a loaded CI
    machine), -1 to +6 MB with one (tests/test_hostile.py measures it). One arena costs
    ingest nothing measurable (docs/BENCHMARKS.md): the replica's work runs on one event loop.
    Call it before the service starts its threads. False off glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, arenas))
