"""`atoll bench scale` end to end at a small size: real replicas, Redis and synthetic learners
streaming over gRPC, with every figure the issue asks of it in the report."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

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
        slowest = run["slowest_merges"][0]
        assert slowest[2] >= run["merge_latency_s"]["p99"] - 1e-3  # the slowest is first
        assert "step" in slowest[3]
        # Where the machine's cores went: the replicas and the learners did work, within it.
        cpu = run["cpu_cores_busy"]
        assert cpu["replicas"] > 0
        assert cpu["learners"] > 0
        assert cpu["machine"] <= cpu["cores"] + 0.5
