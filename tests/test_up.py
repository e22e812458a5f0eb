"""`atoll up` as a user runs it: real Redis, synchronizer and JAX learners as subprocesses."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from cluster.processes import atoll_command
from cluster.report import missing_keys
from services.tape import read as read_tape

SMALL = [
    "--layers",
    "2",
    "--width",
    "64",
    "--heads",
    "4",
    "--context",
    "64",
    "--batch-size",
    "8",
    "--eval-batches",
    "2",
    "--eval-every",
    "0",
]


def up(tmp_path: Path, *args: str, timeout: float = 400) -> dict[str, Any]:
    """Run `atoll up` with a tape; check the tape says what the report says. The report comes
    back with the tape's events under `_tape`."""
    report = tmp_path / "r.json"
    tape = tmp_path / "tape.jsonl"
    proc = subprocess.run(
        [
            *atoll_command("up"),
            "--workdir",
            str(tmp_path / "w"),
            "--report",
            str(report),
            "--tape",
            str(tape),
            *SMALL,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    leftovers = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))
    ]
    assert not leftovers, f"processes left behind: {leftovers}"
    result = dict(json.loads(report.read_text()))
    check = subprocess.run(
        [*atoll_command("check"), str(tape)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    from_tape = json.loads(check.stdout)
    assert from_tape["invariants"]["ok"]
    assert abs(from_tape["goodput"] - result["goodput"]) <= 0.005, (from_tape, result["goodput"])
    assert from_tape["commits"] == result["versions_committed"]
    result["_tape"] = read_tape(tape)
    return result


def test_decoupled_run_trains_commits_and_ends_on_the_global_model(tmp_path: Path) -> None:
    steps, h, p = 60, 20, 4
    report = up(
        tmp_path,
        "--learners",
        "3",
        "--steps",
        str(steps),
        "--inner-steps",
        str(h),
        "--fragments",
        str(p),
        "--plot",
        str(tmp_path / "loss.png"),
    )
    assert missing_keys(report) == []
    assert report["invariants"]["ok"], report["invariants"]  # type: ignore[index]
    log_dir = tmp_path / "w"
    versions = json.loads((log_dir / "learner-0.1.summary.json").read_text())["versions"]
    assert min(versions) >= steps // h - 1
    loss = report["loss"]
    assert loss["final"] < loss["initial"]  # type: ignore[index]
    assert report["eval_loss"] < math.log(256) - 1.0  # type: ignore[operator]
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert report["bytes"]["up"] > 0  # type: ignore[index]
    assert report["bandwidth_reduction"] > 1  # type: ignore[operator]


def test_sync_mode_keeps_every_learner_within_one_fragment_interval(tmp_path: Path) -> None:
    h, p = 8, 2
    report = up(
        tmp_path,
        "--learners",
        "2",
        "--steps",
        "32",
        "--inner-steps",
        str(h),
        "--fragments",
        str(p),
        "--mode",
        "sync",
        "--speeds",
        "[1.0, 0.5]",
        "--log-every",
        "1",
    )
    # The faster learner waits for the slower one's every round: that time is badput
    # (`waiting`), not also compute. Its steps (each timed from when its devices could start
    # it to when they were done) add up to about half the slower one's (--speed 0.5).
    computed = {
        who: sum(e["seconds"] for e in report["_tape"] if e["kind"] == "step" and e["who"] == who)
        for who in ("learner-0", "learner-1")
    }
    assert computed["learner-0"] <= 0.75 * computed["learner-1"], computed
    timelines = []
    for i in range(2):
        summary = json.loads((tmp_path / "w" / f"learner-{i}.1.summary.json").read_text())
        t, step = zip(*[(e[0], e[1]) for e in summary["losses"]], strict=True)
        timelines.append((np.array(t) + summary["started_at"], np.array(step)))
    start = max(t[0] for t, _ in timelines)  # once both are training
    grid = np.linspace(start, min(t[-1] for t, _ in timelines), 200)
    steps = [np.interp(grid, t, s) for t, s in timelines]
    gap = np.max(np.abs(steps[0] - steps[1]))
    assert gap <= h / p + 1, f"a learner ran {gap:.1f} steps ahead in sync mode"


def test_killing_atoll_up_leaves_no_process_behind(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            *atoll_command("up"),
            "--workdir",
            str(tmp_path / "w"),
            *SMALL,
            "--learners",
            "2",
            "--steps",
            "100000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        up = psutil.Process(proc.pid)
        deadline = time.monotonic() + 120
        children: list[psutil.Process] = []
        while len(children) < 4 and time.monotonic() < deadline:  # redis, sync, 2 learners
            time.sleep(0.5)
            children = up.children()
        assert len(children) >= 4, f"the cluster did not start: {children}"
    finally:
        proc.kill()
        proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=20)
    assert not alive, f"left behind after SIGKILL of atoll up: {[p.cmdline() for p in alive]}"
    assert len(gone) == len(children)


def test_a_tls_run_trains_on_mtls_with_invariants_ok(tmp_path: Path) -> None:
    report = up(
        tmp_path,
        "--tls",
        "--learners",
        "2",
        "--steps",
        "24",
        "--inner-steps",
        "8",
        "--fragments",
        "2",
    )
    assert report["invariants"]["ok"], report["invariants"]
    assert report["versions_committed"] > 0
    assert (tmp_path / "w" / "tls" / "ca.crt").is_file()
    log = (tmp_path / "w" / "synchronizer-0.log").read_text()
    assert '"transport": "mtls"' in log
    assert "learner_joined" in log


def test_a_successful_run_removes_its_temporary_folder_unless_kept(tmp_path: Path) -> None:
    tiny = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "32"]
    for keep, left in (("--no-keep", 0), ("--keep", 1)):
        proc = subprocess.run(
            [
                *atoll_command("up"),
                *tiny,
                "--learners",
                "2",
                "--steps",
                "10",
                "--inner-steps",
                "5",
                "--fragments",
                "2",
                "--eval-every",
                "0",
                "--eval-batches",
                "1",
                keep,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert len(list(tmp_path.glob("atoll-up-*"))) == left, proc.stdout


def test_ctrl_c_says_what_it_stops_stops_it_and_unpublishes_the_targets(tmp_path: Path) -> None:
    targets = tmp_path / "targets.json"
    proc = subprocess.Popen(
        [
            *atoll_command("up"),
            "--workdir",
            str(tmp_path / "w"),
            *SMALL,
            "--learners",
            "2",
            "--steps",
            "100000",
            "--metrics",
            "--metrics-targets",
            str(targets),
            "--no-live",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: the test's own process (a pytest-xdist worker) ignores SIGINT,
        # and a child inherits that; a Ctrl-C at a terminal is not ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while "learner-1" not in (targets.read_text() if targets.exists() else ""):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the learners were never launched"
            time.sleep(0.2)
        proc.send_signal(2)  # SIGINT: Ctrl-C
        interrupted = time.monotonic()
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    # Both groups stopped at once: within their two timeouts, whatever the learners did.
    assert time.monotonic() - interrupted < 40
    assert proc.returncode == 130
    assert "atoll up: interrupted; stopping 2 learner(s), 1 synchronizer(s), Redis" in err, err
    assert "Traceback" not in err, err
    assert json.loads(targets.read_text()) == []
    leftovers = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))
    ]
    assert not leftovers, leftovers
