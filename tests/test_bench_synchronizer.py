"""`atoll bench synchronizer` end to end at a small size: a real replica and Redis, the raw
sink, and client processes of their own, with every figure of the report measured."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cluster.processes import atoll_command


def test_the_synchronizer_bench_measures_each_part_with_client_processes(
    tmp_path: Path,
) -> None:
    out = tmp_path / "sync.json"
    proc = subprocess.run(
        [
            *atoll_command("bench", "synchronizer"),
            "--clients",
            "2",
            "--seconds",
            "1.5",
            "--fragment-mib",
            "0.5",
            "--pin",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["clients"] == 2
    for key in (
        "ingest_mb_s",
        "merging_mb_s",
        "raw_grpc_mb_s",
        "raw_per_call_mb_s",
        "floor_mb_s",  # counted only where the summing sink's checksum held
        "store_mb_s",
    ):
        assert report[key] > 0, key
    # the report divides the figures before it rounds them: the third decimal may differ
    assert report["ratio"] == pytest.approx(
        report["ingest_mb_s"] / report["raw_grpc_mb_s"], abs=2e-3
    )
    assert report["merging_ratio"] == pytest.approx(
        report["merging_mb_s"] / report["raw_grpc_mb_s"], abs=2e-3
    )
    assert report["ingest_of_floor"] == pytest.approx(
        report["ingest_mb_s"] / report["floor_mb_s"], abs=2e-3
    )
    cores = os.sched_getaffinity(0)
    if len(cores) >= 2:  # servers on the first half of the cores, clients on the rest
        pinned = report["pinned"]
        assert pinned["servers"]
        assert pinned["clients"]
        assert not set(pinned["servers"]) & set(pinned["clients"])
        assert set(pinned["servers"]) | set(pinned["clients"]) == cores
    cpu = report["cpu_ms_per_mb"]
    assert report["floor_ratio"] == pytest.approx(
        report["floor_mb_s"] / report["raw_grpc_mb_s"], abs=2e-3
    )
    assert set(cpu) == {"held_open", "merging", "raw", "raw_per_call", "floor"}
    for part in ("held_open", "merging"):
        assert set(cpu[part]) == {"replica", "redis", "clients"}
        assert cpu[part]["replica"] > 0
        assert cpu[part]["clients"] > 0  # the client processes' own CPU, reported back
    assert cpu["raw"]["raw_sink"] > 0
    assert cpu["raw"]["clients"] > 0
