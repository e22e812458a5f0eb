"""One learner of two processes (each its own JAX CPU device, through jax.distributed) against
a real synchronizer and Redis: it trains, its updates merge and the run's invariants hold.
Its parameters sharded over both, neither process ever sends or receives the whole model;
replicated on both, the first sends whole fragments, the other nothing, and both fetch them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import redis

from cluster.check import check_tape
from cluster.processes import atoll_command, child_env
from cluster.redis_server import RedisServer
from services import tape
from tests import support
from tests.conftest import SpawnSynchronizer

FRAGMENTS, H, STEPS = 2, 4, 16


def train_two_processes(
    spawn_synchronizer: SpawnSynchronizer,
    redis_server: RedisServer,
    tmp_path: Path,
    layout: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the learner of two processes with its parameters as `layout` says, check what
    holds for any layout, and return both processes' reports."""
    sync = spawn_synchronizer(
        "--fragments", str(FRAGMENTS), "--inner-steps", str(H), "--grace-seconds", "0",
        "--tape", str(tmp_path / "sync.tape"),
    )  # fmt: skip
    report = tmp_path / "learner.json"
    args = atoll_command(
        "learner", "--insecure", "--synchronizer", sync.address, "--id", "two",
        "--processes", "2", "--local-processes", "--steps", str(STEPS),
        "--layers", "2", "--width", "64", "--heads", "2", "--context", "32",
        "--batch-size", "4", "--eval-every", "8", "--eval-batches", "1", "--warmup-steps", "0",
        "--heartbeat-s", "0.2", "--param-layout", layout,
        "--report", str(report), "--tape", str(tmp_path / "l.tape"),
    )  # fmt: skip
    log = tmp_path / "learner.log"
    with log.open("wb") as out:
        done = subprocess.run(args, env=child_env(1), stdout=out, stderr=out, timeout=240)
    assert done.returncode == 0, log.read_text()[-4000:]
    leader = json.loads(report.read_text())
    follower = json.loads((tmp_path / "learner.process-1.json").read_text())

    # Its updates merged: every fragment moved on, each commit holding this learner's update.
    r = redis.Redis(port=redis_server.port)
    versions = [support.version(r, p) for p in range(FRAGMENTS)]
    assert min(versions) >= STEPS // H - 1, versions
    assert leader["versions"] == follower["versions"] == versions
    assert leader["checksums"] == follower["checksums"]
    for p in range(FRAGMENTS):
        log_entries = support.commit_log(r, p)
        assert all(e["uids"][0].startswith("two/") for e in log_entries)
        assert int(log_entries[-1]["checksum"]) == leader["checksums"][p]
    events = [*tape.read(tmp_path / "sync.tape"), *tape.read(tmp_path / "l.tape")]
    invariants = check_tape(events)
    assert invariants.ok, invariants.problems
    assert leader["loss"]["final"] < leader["loss"]["initial"]
    return leader, follower


def test_a_learner_of_two_processes_trains_a_sharded_model_and_each_moves_half(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer, tmp_path: Path
) -> None:
    leader, follower = train_two_processes(spawn_synchronizer, redis_server, tmp_path, "sharded")

    # Neither process held, sent or received the whole model: about half each.
    for p in range(FRAGMENTS):
        held = leader["shards"]["held"][p], follower["shards"]["held"][p]
        assert max(held) < 0.6 * (
            leader["shards"]["sent"][p] + follower["shards"]["sent"][p]
        )  # the fragment
    total = sum(leader["shards"]["sent"]) + sum(follower["shards"]["sent"])
    assert abs(sum(leader["shards"]["sent"]) - total / 2) < 0.1 * total
    up = leader["bytes"]["up"], follower["bytes"]["up"]
    down = leader["bytes"]["down"], follower["bytes"]["down"]
    assert 0.35 < up[1] / sum(up) < 0.65, up
    assert 0.35 < down[1] / sum(down) < 0.65, down


def test_a_learner_of_two_processes_with_replicated_parameters_sends_each_value_once(
    spawn_synchronizer: SpawnSynchronizer, redis_server: RedisServer, tmp_path: Path
) -> None:
    leader, follower = train_two_processes(spawn_synchronizer, redis_server, tmp_path, "replicated")
    # Both hold every fragment whole; the first process sends all of it, the other nothing
    # (one copy of each value, not two), and both fetch every new global value whole.
    assert leader["shards"]["held"] == follower["shards"]["held"] == leader["shards"]["sent"]
    assert follower["shards"]["sent"] == [0] * FRAGMENTS
    up = leader["bytes"]["up"], follower["bytes"]["up"]
    assert up[1] < 0.01 * up[0], up  # requests only
    down = leader["bytes"]["down"], follower["bytes"]["down"]
    assert 0.8 < down[1] / down[0] < 1.25, down
