"""Fixtures: real redis-server processes and real synchronizer processes on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cluster.processes import SynchronizerChild, synchronizer_child
from cluster.redis_server import RedisServer
from services import kernels

SpawnSynchronizer = Callable[..., SynchronizerChild]

# Modules whose tests each run a whole training cluster or benchmark (`atoll up`, `atoll
# bench`, learners training on JAX): each keeps every core busy and some time what happens
# (a learner back within seconds, a commit within a lease). `make test` runs the suite on
# two pytest-xdist workers; these go one after another on one of them (`--dist loadgroup`),
# while the other worker takes the rest, which mostly wait on sockets and timers.
WHOLE_CLUSTERS = {
    "test_bench_quality",
    "test_bench_scale",
    "test_bench_synchronizer",
    "test_containers",
    "test_export",
    "test_faults",
    "test_learner_restart",
    "test_multiprocess_learner",
    "test_own_loop",
    "test_prometheus",
    "test_scale",
    "test_up",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in WHOLE_CLUSTERS:
            item.add_marker(pytest.mark.xdist_group("whole_clusters"))


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
        name = replica or f"sync-{len(children)}"
        child = synchronizer_child(tmp_path, redis_server.url, name, job_args, port=port)
        children.append(child)
        return child.start_and_wait()

    yield spawn
    for child in children:
        child.stop(timeout_s=10)
