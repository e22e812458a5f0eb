"""`atoll up --regions` as root runs it: real namespaces, veth pairs and tbf, real Redis,
replicas and JAX learners. A short two-region job under a rate cap moves its bytes over the
shaped links (the kernel's counters say so), and every namespace is gone afterwards: after a
normal end, after Ctrl-C, after SIGKILL of a learner, and (swept by the next run) after the
run itself was killed. Needs root: without it these tests skip with one line saying so;
under CI (which runs as root) they fail instead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from cluster import regions
from cluster.processes import atoll_command
from tests.test_up import SMALL

if os.geteuid() != 0:
    if os.environ.get("CI") == "true":
        raise RuntimeError("the regions tests must run in CI, which runs as root")
    pytest.skip(
        "regions tests skipped: they make network namespaces, which needs root",
        allow_module_level=True,
    )

RATE_BITS_S = 20_000_000


def namespaces_of(pid: int) -> list[str]:
    return [ns for ns in regions.existing() if ns.startswith(f"atoll-{pid}-")]


def start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *atoll_command("up"),
            "--regions",
            "us:1,eu:1",
            "--link",
            f"rate={RATE_BITS_S}bit",
            "--workdir",
            str(tmp_path / "w"),
            "--no-live",
            *SMALL,
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a pytest-xdist worker ignores SIGINT, and a child inherits that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for_learners_in_regions(proc: subprocess.Popen[str], timeout_s: float = 60) -> None:
    """Until each region's namespace holds a process (its learner)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.communicate()
        names = [ns for ns in namespaces_of(proc.pid) if not ns.endswith("-hub")]
        pids = [
            subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
            for ns in names
        ]
        if len(names) == 2 and all(p.strip() for p in pids):
            return
        assert time.monotonic() < deadline, f"no learners in the regions: {names}"
        time.sleep(0.2)


def assert_nothing_left(proc: subprocess.Popen[str], tmp_path: Path) -> None:
    assert namespaces_of(proc.pid) == [], "namespaces left behind"
    host_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"a{proc.pid}h" not in host_links
    assert f"a{proc.pid}r" not in host_links
    leftovers = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))
    ]
    assert not leftovers, f"processes left behind: {leftovers}"


def test_a_two_region_job_sends_its_bytes_over_the_shaped_links_and_removes_them(
    tmp_path: Path,
) -> None:
    report = tmp_path / "r.json"
    proc = start(tmp_path, "--steps", "24", "--inner-steps", "8", "--report", str(report))
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert_nothing_left(proc, tmp_path)
    result = json.loads(report.read_text())
    assert result["invariants"]["ok"]
    links = result["regions"]
    assert links["link"] == {"rate_bits_s": RATE_BITS_S, "delay_s": 0.0}
    summaries = {
        s["learner"]: s
        for s in (json.loads(p.read_text()) for p in (tmp_path / "w").glob("*.summary.json"))
    }
    for region, learner in (("us", "learner-0"), ("eu", "learner-1")):
        link = links[region]
        assert link["learners"] == [learner]
        # Every byte the learner sent and received crossed its region's link: the kernel's
        # counters at the hub's end hold at least the learner's own payload count.
        sent, received = summaries[learner]["bytes"]["up"], summaries[learner]["bytes"]["down"]
        assert sent > 0
        assert received > 0
        assert link["bytes_up"] >= sent, (link, sent)
        assert link["bytes_down"] >= received, (link, received)
        # ... through the token bucket the kernel held at the rate asked for.
        assert link["shaped_rate_bits_s"] == RATE_BITS_S
        assert link["shaped_bytes_down"] >= received
        assert 0 < link["utilisation"]["up"] < 1


def test_ctrl_c_stops_the_cluster_and_removes_every_namespace(tmp_path: Path) -> None:
    proc = start(tmp_path, "--steps", "100000")
    try:
        wait_for_learners_in_regions(proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "3 network namespaces" in err, err
    assert "Traceback" not in err, err
    assert_nothing_left(proc, tmp_path)


def test_sigkill_of_a_learner_ends_the_run_and_removes_every_namespace(tmp_path: Path) -> None:
    proc = start(tmp_path, "--steps", "100000")
    try:
        wait_for_learners_in_regions(proc)
        us = subprocess.run(
            ["ip", "netns", "pids", f"atoll-{proc.pid}-us"], capture_output=True, text=True
        ).stdout.split()
        os.kill(int(us[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "learner-0 failed" in err, err
    assert_nothing_left(proc, tmp_path)


def test_the_namespaces_of_a_killed_run_are_swept_and_live_ones_kept() -> None:
    dead = psutil.Popen(["true"])
    dead.wait()  # a PID no process has now
    mine = regions.plan(regions.parse_regions("us:1"), regions.LinkShape(10**8), os.getpid())
    theirs = regions.plan(regions.parse_regions("us:1"), regions.LinkShape(10**8), dead.pid)
    try:
        regions.create(mine)
        regions.create(theirs)
        swept = regions.sweep_stale()
        assert set(theirs.namespaces) <= set(swept)
        assert set(mine.namespaces) <= set(regions.existing())
    finally:
        regions.remove(theirs)
        regions.remove(mine)
    assert not set(mine.namespaces + theirs.namespaces) & set(regions.existing())


def test_network_chaos_hits_a_regions_link_and_the_run_recovers(tmp_path: Path) -> None:
    """--chaos with --regions: the fault proxy sits in the hub, on every learner's path after
    its region's link; a partition of learner-0 (region us) cuts only its connections."""
    report = tmp_path / "r.json"
    proc = start(
        tmp_path,
        "--link", f"rate={RATE_BITS_S}bit,delay=20ms",
        "--chaos", "net-partition:at=1s,for=3s,victim=0",
        "--steps", "48", "--inner-steps", "8", "--report", str(report),
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert_nothing_left(proc, tmp_path)
    result = json.loads(report.read_text())
    assert result["invariants"]["ok"]
    assert result["faults"]["injected"] == 1
    assert result["regions"]["link"]["delay_s"] == 0.02
    reconnects = {
        s["learner"]: s["reconnects"]
        for s in (json.loads(p.read_text()) for p in (tmp_path / "w").glob("*.summary.json"))
    }
    assert reconnects["learner-0"] > 0, reconnects
    assert reconnects["learner-1"] == 0, reconnects


def test_data_parallel_reduces_every_step_across_the_regions_links(tmp_path: Path) -> None:
    """--data-parallel: one learner whose two processes sit in us and eu; its collectives
    cross both shaped links every step, far more bytes than its one sync at the end."""
    report = tmp_path / "r.json"
    steps = 8
    proc = start(
        tmp_path, "--data-parallel", "--data-split", "windows",
        "--steps", str(steps), "--report", str(report),
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert_nothing_left(proc, tmp_path)
    result = json.loads(report.read_text())
    assert result["invariants"]["ok"]
    leader = json.loads((tmp_path / "w" / "learner-0.1.summary.json").read_text())
    follower = json.loads((tmp_path / "w" / "learner-0.1.summary.process-1.json").read_text())
    assert leader["steps"] == follower["steps"] == steps
    assert leader["checksums"] == follower["checksums"]
    to_synchronizer = leader["bytes"]["up"] + follower["bytes"]["up"]
    for region in ("us", "eu"):
        link = result["regions"][region]
        assert link["bytes_up"] > 5 * to_synchronizer, (link, to_synchronizer)
        assert link["bytes_down"] > 5 * to_synchronizer, (link, to_synchronizer)
