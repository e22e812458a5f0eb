"""Fixtures: real redis-server processes and real synchronizer processes on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.processes import SynchronizerChild, synchronizer_child
from cluster.redis_server import RedisServer
from services import kernels

SpawnSynchronizer = Callable[..., SynchronizerChild]

# Modules whose tests each run a whole training cluster or benchmark (`atoll up`, `atoll
# bench`, learners training on JAX): each keeps every core busy and some time what happens
# (a learner back within seconds, a commit within a lease). `make test` runs the suite on
# two pytest-xdist workers: these go one after another on one of them, while the other
# worker takes the rest, which mostly wait on sockets and timers.
WHOLE_CLUSTERS = frozenset(
    {
        "test_bench_scale",
        "test_bench_synchronizer",
        "test_command_line",
        "test_containers",
        "test_faults",
        "test_learner_restart",
        "test_own_loop",
        "test_prometheus",
        "test_regions",
        "test_scale",
        "test_up",
    }
)
WHOLE_CLUSTERS_SCOPE = "whole clusters"
# Modules that run `atoll up` or `atoll bench` too but time nothing: they assert what was
# trained, exported and moved, under generous limits. That chain is the suite's wall time,
# so these go to the other worker, beside its own JAX tests, each test alone.
UNTIMED_CLUSTERS = frozenset({"test_bench_quality", "test_export", "test_multiprocess_learner"})


def scope_of(nodeid: str) -> str:
    """The unit of work a test goes to a worker in: every whole-cluster test in one (the
    largest, so a worker starts on it first), every other test alone."""
    module = nodeid.split("::", 1)[0]
    return WHOLE_CLUSTERS_SCOPE if Path(module).stem in WHOLE_CLUSTERS else nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scheduling by scope, with `scope_of`'s scopes. (Its `xdist_group` marks
    are not applied under this pytest: the group a mark names never reaches the node ids
    the scheduler reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class WholeClustersApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return WholeClustersApart(config, log)


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels() -> None:
    """The synchronizer's compiled decoders, once, into numba's on-disk cache: every replica
    a test starts then loads them instead of compiling (a first compile takes seconds on a
    busy machine, which tests that time a replica's start would count)."""
    kernels.warm()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as server:
        yield server


@pytest.fixture
def spawn_synchronizer(tmp_path: Path, redis_server: RedisServer) -> Iterator[SpawnSynchronizer]:
    children: list[SynchronizerChild] = []

    def spawn(*job_args: str, replica: str | None = None, port: int = 0) -> SynchronizerChild:
        # These tests' clients are not learners on a schedule: they send whichever fragment
        # they please and no step times, so a round of every live learner would wait out the
        # cap for ones that never come. Each update is its own round unless a test says (the
        # every-learner default is tested by the rounds' unit tests and the clusters).
        if "--quorum" not in job_args:
            job_args = ("--quorum", "1", *job_args)
        name = replica or f"sync-{len(children)}"
        child = synchronizer_child(tmp_path, redis_server.url, name, job_args, port=port)
        children.append(child)
        return child.start_and_wait()

    yield spawn
    for child in children:
        child.stop(timeout_s=10)
