"""Integration with local containers (testcontainers): Redis and a synchronizer run as
containers built from atoll's image, learners run on the host and connect over loopback
(host networking, nothing published), a container is killed and restarted, and training
goes on.

The image comes from `ATOLL_TEST_IMAGE` (`.ci/run` builds it from deploy/Dockerfile on a
debootstrap base), Redis from `ATOLL_REDIS_IMAGE` (an image with `redis-server`). Where no
Docker engine answers these tests skip with one line saying so; under CI they fail instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cluster.processes import Child, atoll_command, child_env, synchronizer_args
from cluster.redis_server import free_port
from synchronizer.store.keys import JobKeys
from tests.test_up import SMALL

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

IMAGE = os.environ.get("ATOLL_TEST_IMAGE", "atoll:dev")
REDIS_IMAGE = os.environ.get("ATOLL_REDIS_IMAGE", "redis:7-bookworm")
JOB = "containers"


def _engine_problem() -> str | None:
    try:
        import docker

        client = docker.from_env(timeout=5)
        client.ping()
        for image in (IMAGE, REDIS_IMAGE):
            client.images.get(image)
    except Exception as err:  # no engine, no socket, no image: all say why below
        return f"{type(err).__name__}: {err}"
    return None


PROBLEM = _engine_problem()
if PROBLEM is not None:
    if os.environ.get("CI") == "true":
        raise RuntimeError(
            f"container tests must run in CI, but the Docker engine or an image is missing "
            f"({PROBLEM}); .ci/run starts dockerd and builds {IMAGE}"
        )
    pytest.skip(
        f"container tests skipped: no Docker engine or image {IMAGE}/{REDIS_IMAGE} here "
        f"({PROBLEM.splitlines()[0][:120]})",
        allow_module_level=True,
    )

from testcontainers.core.container import DockerContainer  # noqa: E402


def container(image: str, *command: str) -> DockerContainer:
    return DockerContainer(image).with_command(list(command)).with_kwargs(network_mode="host")


def wait_until(check: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(check) and check():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not happen within {timeout_s} s")


@pytest.fixture
def redis_container() -> Iterator[tuple[DockerContainer, int]]:
    port = free_port()
    c = container(
        REDIS_IMAGE,
        "redis-server",
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--appendonly",
        "yes",
        "--dir",
        "/tmp",
    )
    c.start()
    client = redis.Redis(port=port, socket_connect_timeout=1)
    try:
        wait_until(lambda: _pings(client), 30, "Redis in its container answering")
        yield c, port
    finally:
        client.close()
        c.stop()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def synchronizer_container(redis_port: int, port: int) -> DockerContainer:
    return container(
        IMAGE,
        *synchronizer_args(port, f"redis://127.0.0.1:{redis_port}/0", "/tmp/atoll-tensors"),
        "--job",
        JOB,
        "--fragments",
        "2",
        "--inner-steps",
        "10",
        "--log-level",
        "warning",
    )


def test_learners_on_the_host_train_through_a_containerized_synchronizer_that_is_killed(
    tmp_path: Path, redis_container: tuple[DockerContainer, int]
) -> None:
    _, redis_port = redis_container
    port = free_port()
    sync = synchronizer_container(redis_port, port)
    sync.start()
    r = redis.Redis(port=redis_port)
    learners: list[Child] = []
    try:
        for i in range(2):
            args = atoll_command(
                "learner",
                "--insecure",
                *SMALL,
                "--synchronizer",
                f"127.0.0.1:{port}",
                "--id",
                f"learner-{i}",
                "--job",
                JOB,
                "--steps",
                "400",
                "--shard",
                str(i),
                "--num-shards",
                "2",
                "--max-backoff-s",
                "1",
                "--report",
                str(tmp_path / f"learner-{i}.json"),
            )
            learners.append(
                Child(f"learner-{i}", args, tmp_path / f"learner-{i}.log", child_env()).start()
            )

        def versions() -> int:
            return sum(int(r.hget(JobKeys(JOB).frag(p), "version") or 0) for p in range(2))

        wait_until(lambda: versions() >= 4, 180, "rounds committing through the container")
        before = versions()
        sync.get_wrapped_container().kill()  # SIGKILL
        time.sleep(2)
        sync.get_wrapped_container().start()  # the same container, the same port
        wait_until(lambda: versions() >= before + 4, 180, "rounds committing after the restart")
        for child in learners:
            assert child.process is not None
            child.process.wait(timeout=300)
            assert child.process.returncode == 0, child.tail()
        summaries = [json.loads((tmp_path / f"learner-{i}.json").read_text()) for i in range(2)]
        assert all(s["steps"] == 400 for s in summaries)
        assert sum(s["reconnects"] for s in summaries) >= 2  # both came back to it
        committed = [int(r.hget(JobKeys(JOB).frag(p), "version") or 0) for p in range(2)]
        for s in summaries:  # it trained: lower loss, and its model is one the job committed
            assert s["loss"]["final"] < s["loss"]["initial"]
            assert all(0 < v <= c for v, c in zip(s["versions"], committed, strict=True))
    finally:
        for child in learners:
            child.stop()
        sync.stop()
        r.close()


def test_the_image_runs_as_a_non_root_user_and_answers_help() -> None:
    out = subprocess.run(
        ["docker", "run", "--rm", "--network", "host", IMAGE, "synchronizer", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "--redis-url" in out.stdout
    uid = subprocess.run(
        ["docker", "run", "--rm", "--network", "host", "--entrypoint", "id", IMAGE, "-u"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert uid.stdout.strip() == "10001"
