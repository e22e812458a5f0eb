"""Fixtures: real redis-server processes and real synchronizer processes on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cluster.processes import SynchronizerChild, synchronizer_child
from cluster.redis_server import RedisServer
from services import kernels

SpawnSynchronizer = Callable[..., SynchronizerChild]


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
