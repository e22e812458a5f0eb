"""`atoll bench scale` end to end at a small size: real replicas, Redis and synthetic learners
streaming over gRPC, with every figure the issue asks of it in the report."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.scale import cpu_seconds, freshness, pinning
from cluster.processes import atoll_command

KEYS = {
    "params",
    "replicas",
    "ingest_mb_s",
    "scaling_efficiency",
    "merges",
    "peak_rss_mb_per_replica",
    "redis_used_memory_peak_mb",
    "max_redis_value_bytes",
    "merge_latency_s",
}


def test_the_scale_bench_merges_over_one_and_two_replicas_and_says_where_time_went(
    tmp_path: Path,
) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [
            *atoll_command("bench", "scale"),
            "--params",
            "4e5",
            "--fragments",
            "2",
            "--replicas",
            "1,2",
            "--learners",
            "2",
            "--calls",
            "2",
            "--seconds",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) >= KEYS
    assert report["replicas"] == [1, 2]
    assert report["calls"] == 2
    assert report["merges"] > 0
    assert report["max_redis_value_bytes"] <= 1 << 20
    assert set(report["merge_latency_s"]) == {"p50", "p99"}
    for run in report["runs"]:
        assert run["updates_received"] > 0
        assert sum(run["fragments_owned"]) == 2
        # The replicas' own metrics say what each call waited for and where merges went.
        assert {"read", "sum", "record", "downlink"} <= set(run["ingest_wait_mean_s"])
        assert {"step", "delta_write", "checksum", "commit"} <= set(run["merge_phase_mean_s"])
        # How fresh the learners' view was: their updates merged and came back to them.
        assert 0 < run["newer_version_s"]["p50"] <= run["newer_version_s"]["p99"]
        assert 0 <= run["push_lag_s"]["p50"] <= run["push_lag_s"]["p99"]
        assert run["calls_refused"] == {}
        slowest = run["slowest_merges"][0]
        assert slowest[2] >= run["merge_latency_s"]["p99"] - 1e-3  # the slowest is first
        assert "step" in slowest[3]
        # Where the machine's cores went: the replicas and the learners did work, within it.
        cpu = run["cpu_cores_busy"]
        assert cpu["replicas"] > 0
        assert cpu["learners"] > 0
        assert cpu["machine"] <= cpu["cores"] + 0.5


def test_freshness_pairs_receipts_with_the_next_version_seen_and_commits_with_arrivals() -> None:
    result = {
        # Fragment 0 received at version 3 at t=10, at version 5 at t=20 (never newer seen).
        "received_at": [[0, 3, 10.0], [0, 5, 20.0], [1, 0, 11.0]],
        # Version 4 of fragment 0 first seen at t=12.5, version 5 at t=14; fragment 1's
        # version 1 came before its update was received (not an answer to it), version 2 after.
        "seen_at": [[0, 4, 12.5], [0, 5, 14.0], [1, 1, 10.5], [1, 2, 13.0]],
    }
    log = [
        {"fragment": 0, "version": 4, "committed_at": 12.0},
        {"fragment": 0, "version": 5, "committed_at": 13.0},
        {"fragment": 1, "version": 2, "committed_at": 12.75},
        {"fragment": 1, "version": 1},  # an entry without a commit time is skipped
    ]
    newer, lags = freshness([result], log)
    assert newer == [2.5, 2.0]
    assert sorted(lags) == [0.25, 0.5, 1.0]


def test_a_bench_stopped_by_sigterm_removes_its_folders_and_leaves_no_process(
    tmp_path: Path,
) -> None:
    """A timeout that stops a bench (SIGTERM) leaves nothing behind: at 1e9 its temporary
    folder holds tens of GB of tensor store, and a machine's disk fills run after run."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    small = ["--params", "4e5", "--fragments", "2", "--replicas", "1", "--learners", "2"]
    bench = subprocess.Popen(
        [*atoll_command("bench", "scale"), *small, "--seconds", "60"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        # Until its replica and learners run (the learners write nothing before they end).
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not list(tmp_path.glob("atoll-bench-scale-*/*/*")):
            time.sleep(0.5)
        assert list(tmp_path.glob("atoll-bench-scale-*")), "the bench never started"
        time.sleep(3)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        assert not list(tmp_path.glob("atoll-bench-scale-*"))
        assert not _in_session(bench.pid)  # none of its processes lives on
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)


def _in_session(sid: int) -> list[str]:
    """The processes of session `sid` still alive (from /proc: its 6th stat field)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                alive.append(stat.parent.name)
    return alive


def test_cpu_seconds_of_a_process_that_is_gone_fail_rather_than_read_zero() -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )  # exited and reaped: no longer in /proc
    assert cpu_seconds(os.getpid()) > 0
    with pytest.raises(ProcessLookupError, match="exited during the measurement"):
        cpu_seconds(int(gone.stdout))


def test_pinning_gives_each_replica_cores_of_its_own_and_the_learners_the_last() -> None:
    replicas, learners = pinning(range(16), 4, 3)
    assert learners == (12, 13, 14, 15)
    assert replicas == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert pinning(range(16), 0, 2) == ([(), ()], ())  # nothing pinned


def test_pinning_refuses_a_replica_without_a_core_and_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="fewer than one each"):
        pinning(range(4), 2, 3)
