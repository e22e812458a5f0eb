"""A real Prometheus scrapes `atoll up --metrics` through its file_sd targets: it sees every
learner and replica, and its goodput over the run is the report's."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cluster.processes import atoll_command
from cluster.redis_server import free_port
from tests.test_up import SMALL

PROMETHEUS = shutil.which("prometheus")
DASHBOARD = Path(__file__).resolve().parents[1] / "helm" / "atoll" / "files" / "atoll-goodput.json"


def dashboard_goodput() -> str:
    """The dashboard's live goodput, as Grafana sends it with every region selected (the
    variable's all-value) and a rate window of 5 scrapes."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    (expr,) = [t["expr"] for p in panels if p["title"] == "Goodput (live)" for t in p["targets"]]
    return expr.replace("$region", ".*").replace("$__rate_interval", "5s")


def query(port: int, expr: str, at: float) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode(
        {"query": expr, "time": at}
    )
    with urllib.request.urlopen(url, timeout=10) as reply:
        return list(json.load(reply)["data"]["result"])


def query_range(port: int, expr: str, start: float, end: float) -> list[float]:
    url = f"http://127.0.0.1:{port}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": expr, "start": start, "end": end, "step": 1}
    )
    with urllib.request.urlopen(url, timeout=10) as reply:
        result = json.load(reply)["data"]["result"]
    return [float(v) for series in result for _, v in series["values"]]


def scalar(port: int, expr: str, at: float) -> float:
    result = query(port, expr, at)
    assert result, f"no data for {expr}"
    return float(result[0]["value"][1])


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian: prometheus)")
def test_prometheus_sees_every_process_and_agrees_with_the_report_on_goodput(
    tmp_path: Path,
) -> None:
    assert PROMETHEUS is not None
    targets = tmp_path / "targets.json"
    targets.write_text("[]\n")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: atoll\n"
        f"    file_sd_configs: [{{files: ['{targets}'], refresh_interval: 1s}}]\n"
    )
    port = free_port()
    prometheus = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("w"),
    )
    try:
        started = time.time()
        report_path = tmp_path / "r.json"
        proc = subprocess.run(
            [
                *atoll_command("up"),
                "--workdir",
                str(tmp_path / "w"),
                "--report",
                str(report_path),
                *SMALL,
                "--learners",
                "3",
                "--synchronizers",
                "2",
                "--steps",
                "600",  # long enough that the killed learner is back and scraped before the end
                "--inner-steps",
                "30",
                "--fragments",
                "3",
                "--chaos",
                "learner-kill:at=5s,down=3s,victim=1",
                "--metrics",
                "--metrics-targets",
                str(targets),
            ],
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert str(targets) in proc.stdout
        report = json.loads(report_path.read_text())
        end = time.time()
        time.sleep(1.5)  # let the last scrape land in the database
        # The file's job labels win over the scrape config's job_name, as the alert rules
        # expect them.
        slots = {
            (r["metric"]["job"], r["metric"].get("slot", ""))
            for r in query(port, "max_over_time(up[10m])", end)
        }
        assert slots == {
            ("atoll-up", ""),
            ("atoll-synchronizer", "synchronizer-0"),
            ("atoll-synchronizer", "synchronizer-1"),
            ("atoll-learner", "learner-0"),
            ("atoll-learner", "learner-1"),
            ("atoll-learner", "learner-2"),
        }
        useful = scalar(port, "sum(max_over_time(atoll_useful_seconds_total[10m]))", end)
        provisioned = scalar(port, "sum(max_over_time(atoll_provisioned_seconds_total[10m]))", end)
        assert abs(useful / provisioned - report["goodput"]) <= 0.01, (
            useful,
            provisioned,
            report["goodput"],
            report["useful_seconds"],
            report["provisioned_seconds"],
        )
        # Restarts included: the killed learner's slot was scraped again once it came back.
        assert scalar(port, 'changes(process_start_time_seconds{slot="learner-1"}[10m])', end) >= 1
        live = query_range(port, dashboard_goodput(), started, end)
        assert live
        # Each rate is estimated from about five samples stamped when their scrape began, of
        # targets scraped at different moments of each second: on a busy machine a late
        # scrape moves either rate by a few percent (1.044 seen in CI). Useful time credited
        # in lumps (a merge's steps at once) would read 2 and more over a 5 s window.
        assert max(live) <= 1.2, max(live)
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
