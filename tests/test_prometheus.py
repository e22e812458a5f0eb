"""A real Prometheus (the Debian package's, as CI installs it) scrapes `atoll up --metrics`
through its file_sd targets, with the chart's alert rules loaded (each `for` cut 120-fold,
to 10 s at least), through a run with a learner kill and a replica kill (down longer than
the shortest `for`, so its absence pages). Then, as an operator would see it: every
dashboard panel's expression (read from the dashboard, its variables set) stays in its
valid range; goodput by every documented expression is the report's within 0.01; updates
accepted are the report's; alerts fire for the faults injected and for nothing else, and
none fires once the run is over."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from cluster.processes import atoll_command
from cluster.redis_server import free_port
from tests.test_up import SMALL

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = shutil.which("prometheus")
DASHBOARD = ROOT / "helm" / "atoll" / "files" / "atoll-goodput.json"
RULES = ROOT / "helm" / "atoll" / "files" / "alerts.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
JOB = "prom-faults"
LEARNERS = 3
SCRAPE_S = 1
RATE_WINDOW = "4s"  # Grafana's $__rate_interval: four scrape intervals
FOR_CUT = 120  # `for: 15m` waits 7.5 s here
# ... but never less than this: Prometheus applies a file_sd change to its targets up to 5 s
# after the file changed, and scrapes a target that left meanwhile in vain. A `for` under
# that would page for every process that exits, as 2 minutes never does.
FOR_FLOOR_S = 10
AFTER_S = 15.0  # watched once the run is over: past the floor, and past the targets' removal
RECONNECT_S = 3  # a learner's new session, once its old one's lease lapsed (see below)
# Alerts firing when the run ends (its goodput; the killed replica's, where a fast machine ends
# the run before the replica is back) resolve once the emptied targets file takes effect:
# file_sd reads it within its 1 s refresh, Prometheus applies target changes at most every
# 5 s, and the rules' next evaluation then sees the series gone.
SETTLE_S = 8.0


def cut_for(rules: str) -> str:
    """The rules with each `for: Nm` divided by FOR_CUT (windows unchanged)."""

    def shorter(match: re.Match[str]) -> str:
        return f"for: {max(FOR_FLOOR_S * 1000, int(match.group(1)) * 60_000 // FOR_CUT)}ms"

    return re.sub(r"for: (\d+)m\b", shorter, rules)


def documented_run_goodput() -> str:
    """The docs' expression of goodput over a run or a time range, as written there."""
    text = OPERATIONS.read_text()
    section = text[text.index("**Over a run or a time range**") :]
    return section[section.index("`") + 1 : section.index("`", section.index("`") + 1)]


def templated(expr: str, range_s: int) -> str:
    """A panel's expression as Grafana sends it: this job, every region, the rate window of
    four scrapes, the whole run as the dashboard's time range."""
    return (
        expr.replace("$job", JOB)
        .replace("$region", ".*")
        .replace("$__rate_interval", RATE_WINDOW)
        .replace("$__range", f"{range_s}s")
    )


class Api:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}/api/v1/"

    def get(self, path: str, **params: object) -> Any:
        url = self.base + path + "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=20) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def instant(self, expr: str, at: float) -> list[dict[str, Any]]:
        return list(self.get("query", query=expr, time=at)["result"])

    def scalar(self, expr: str, at: float) -> float:
        result = self.instant(expr, at)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    def value(self, expr: str, at: float) -> float | None:
        """An expression's one value; None where it has none (or several)."""
        result = self.instant(expr, at)
        return float(result[0]["value"][1]) if len(result) == 1 else None

    def series(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        return list(
            self.get("query_range", query=expr, start=start, end=end, step=SCRAPE_S)["result"]
        )


@contextmanager
def prometheus(tmp_path: Path, targets: Path) -> Iterator[Api]:
    assert PROMETHEUS is not None, "no prometheus on PATH: install the Debian package prometheus"
    rules = tmp_path / "alerts.yaml"
    rules.write_text(cut_for(RULES.read_text()))
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"global: {{scrape_interval: {SCRAPE_S}s, evaluation_interval: {SCRAPE_S}s}}\n"
        f"rule_files: ['{rules}']\n"
        "scrape_configs:\n"
        "  - job_name: atoll\n"
        f"    file_sd_configs: [{{files: ['{targets}'], refresh_interval: 1s}}]\n"
    )
    port = free_port()
    process = subprocess.Popen(
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
        api = Api(port)
        deadline = time.monotonic() + 30
        while True:
            try:
                groups = api.get("rules")["groups"]
                break
            except OSError:
                assert process.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "Prometheus did not start"
                time.sleep(0.2)
        assert sum(len(g["rules"]) for g in groups) == 5  # the chart's rules, all loaded
        yield api
    finally:
        process.terminate()
        process.wait(timeout=30)


def values(series: list[dict[str, Any]]) -> list[float]:
    return [float(v) for s in series for _, v in s["values"]]


def timeline(api: Api, expr: str, start: float, end: float) -> list[tuple[float, float]]:
    """One series' (time, value) points."""
    (series,) = api.series(expr, start, end)
    return [(float(t), float(v)) for t, v in series["values"]]


def points(api: Api, expr: str, start: float, end: float) -> list[tuple[float, float]]:
    """Every series' (time, value) points (none where the expression has no data)."""
    return [(float(t), float(v)) for s in api.series(expr, start, end) for t, v in s["values"]]


def finite(xs: list[float]) -> list[float]:
    return [x for x in xs if math.isfinite(x)]


def whole(x: float) -> bool:
    return x == int(x)


def check_panel(
    panel_id: int, ref: str, xs: list[float], report: dict[str, Any], graced: bool = True
) -> str | None:
    """What is wrong with a time series panel target's values over the run, or None.
    `graced`: whether any round waited a grace window (else that panel has no data)."""
    ok = finite(xs)
    versions = report["versions_committed"]
    checks: dict[tuple[int, str], tuple[bool, str]] = {
        # Goodput, live: never above 1 but for the rate's estimate (a late scrape on a busy
        # machine moves either rate by a few percent; credit in lumps would read 2 and more).
        (1, "A"): (bool(ok) and all(0 <= x <= 1.2 for x in ok), "goodput in [0, 1.2]"),
        (1, "B"): (all(0 <= x <= 1.2 for x in ok), "goodput in [0, 1.2]"),
        (2, "A"): (bool(ok) and all(x >= 0 for x in ok), "badput >= 0"),
        (3, "A"): (bool(ok) and all(0 <= x <= LEARNERS for x in ok), "learners up"),
        (3, "B"): (all(0 <= x <= LEARNERS for x in ok), "learners down"),
        (3, "C"): (bool(ok) and all(0 <= x <= LEARNERS for x in ok), "learners live"),
        (4, "A"): (bool(ok) and all(x >= 0 for x in ok), "tokens/s >= 0"),
        (5, "A"): (
            bool(ok) and all(whole(x) and 1 <= x <= LEARNERS for x in ok),
            "quorum a whole number of learners",
        ),
        # Empty where no round waited a grace window: on a loaded machine every round of a
        # run can be complete when its owner looks (one full run in two here).
        (5, "B"): ((bool(ok) or not graced) and all(x >= 0 for x in ok), "grace >= 0"),
        (6, "A"): (bool(ok) and all(whole(x) and x >= 0 for x in ok), "staleness whole"),
        (6, "B"): (bool(ok) and all(whole(x) and x >= 0 for x in ok), "staleness whole"),
        (7, "A"): (bool(ok) and all(x >= 0 for x in ok), "bytes/s >= 0"),
        (7, "B"): (bool(ok) and all(x >= 0 for x in ok), "bytes/s >= 0"),
        (7, "C"): (bool(ok) and all(x >= 0 for x in ok), "bytes/s >= 0"),
        # Never 0: a loss is absent before a new incarnation's first step or evaluation.
        (8, "A"): (bool(ok) and len(ok) == len(xs) and all(0 < x < 20 for x in ok), "loss"),
        (8, "B"): (bool(ok) and len(ok) == len(xs) and all(0 < x < 20 for x in ok), "eval"),
        (9, "A"): (
            bool(ok) and all(whole(x) and 0 <= x <= versions for x in ok),
            "fragment versions",
        ),
        (10, "A"): (bool(ok) and all(x >= 0 for x in ok), "updates/s >= 0"),
        (10, "B"): (bool(ok) and all(x >= 0 for x in ok), "refusals/s >= 0"),
    }
    good, what = checks[(panel_id, ref)]
    if good:
        return None
    shown = sorted(set(xs))
    return f"panel {panel_id}/{ref} ({what}): {shown[:5]} ... {shown[-5:]} of {len(xs)}"


def firing(
    api: Api, start: float, end: float
) -> dict[str, list[tuple[dict[str, str], float, float]]]:
    """Each alert that fired in [start, end]: its labels, first and last time firing."""
    out: dict[str, list[tuple[dict[str, str], float, float]]] = {}
    for s in api.series('ALERTS{alertstate="firing"}', start, end):
        times = [float(t) for t, _ in s["values"]]
        labels = s["metric"]
        out.setdefault(labels["alertname"], []).append((labels, min(times), max(times)))
    return out


def test_prometheus_tells_the_truth_about_a_run_with_faults(tmp_path: Path) -> None:
    assert PROMETHEUS is not None, "no prometheus on PATH: install the Debian package prometheus"
    targets = tmp_path / "targets.json"
    targets.write_text("[]\n")
    report_path = tmp_path / "r.json"
    with prometheus(tmp_path, targets) as api:
        launched = time.time()
        proc = subprocess.run(
            [
                *atoll_command("up"),
                "--workdir",
                str(tmp_path / "w"),
                "--report",
                str(report_path),
                *SMALL,
                "--eval-every",
                "20",
                "--job",
                JOB,
                "--learners",
                str(LEARNERS),
                "--synchronizers",
                "2",
                "--steps",
                "400",  # the run must outlast the replica's kill at 8 s (200 steps ended first)
                "--inner-steps",
                "30",
                "--fragments",
                "3",
                "--chaos",
                "learner-kill:at=4s,down=3s,victim=1;synchronizer-kill:at=8s,down=12s,victim=0",
                "--metrics",
                "--metrics-targets",
                str(targets),
                "--plot",
                str(tmp_path / "loss.png"),
            ],
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        end = time.time()
        report = json.loads(report_path.read_text())
        assert (tmp_path / "loss.png").stat().st_size > 10_000  # restarts and merges marked
        # Every problem is collected, so a failure lists them all.
        problems: list[str] = []
        # What `atoll up` published is gone with it: no target left to read as down.
        if json.loads(targets.read_text()) != []:
            problems.append("the targets file still lists the run's processes")
        time.sleep(AFTER_S)
        watched = time.time()
        range_s = math.ceil(end - launched) + 2
        assert range_s < 300  # the dashboard's "last 5 minutes" hold the whole run

        # Every process was scraped, with the labels the rules and panels select on; the
        # killed learner's slot was scraped again once it came back.
        slots = {
            (r["metric"]["job"], r["metric"].get("slot", ""), r["metric"].get("atoll_job"))
            for r in api.instant(f"max_over_time(up[{range_s}s])", end)
        }
        expected = {
            ("atoll-up", "", JOB),
            ("atoll-synchronizer", "synchronizer-0", JOB),
            ("atoll-synchronizer", "synchronizer-1", JOB),
            *{("atoll-learner", f"learner-{i}", JOB) for i in range(LEARNERS)},
        }
        if slots != expected:
            problems.append(f"targets (job, slot, atoll_job): {sorted(slots, key=str)}")
        restarts = f'changes(process_start_time_seconds{{slot="learner-1"}}[{range_s}s])'
        assert api.scalar(restarts, end) >= 1

        # Goodput: by the docs' expression, the dashboard's stat and the alert's, the report's.
        dashboard = json.loads(DASHBOARD.read_text())
        panels = {p["id"]: p for p in dashboard["panels"]}
        (stat,) = [t["expr"] for t in panels[105]["targets"]]
        alert_expr = next(
            r["expr"]
            for g in yaml.safe_load(RULES.read_text())["groups"]
            for r in g["rules"]
            if r.get("alert") == "AtollGoodputLow"
        )
        goodputs = {
            "docs": documented_run_goodput().replace("[R]", f"[{range_s}s]"),
            "panel 105": templated(stat, range_s),
            # Its last 5 minutes hold the whole run.
            "panel 101": templated(panels[101]["targets"][0]["expr"], range_s),
            "alert": alert_expr.split(" < 0.7")[0].replace("[15m]", f"[{range_s}s]"),
        }
        for name, expr in goodputs.items():
            got = api.value(expr, end)
            if got is None or abs(got - report["goodput"]) > 0.01:
                problems.append(f"goodput by {name}: {got}, report {report['goodput']}")
        # The stats: updates accepted, bandwidth against data-parallel, the newest version.
        stat_106 = panels.get(106, {"targets": [{"expr": "absent(up)"}]})["targets"][0]["expr"]
        accepted = api.value(templated(stat_106, range_s), end)
        if accepted != report["updates"]["accepted"]:
            problems.append(f"updates accepted {accepted}, report {report['updates']['accepted']}")
        reduction = api.value(templated(panels[103]["targets"][0]["expr"], range_s), end)
        if reduction is None or not 0.5 <= reduction / report["bandwidth_reduction"] <= 2:
            problems.append(
                f"bandwidth vs data-parallel {reduction}x, report's "
                f"{report['bandwidth_reduction']}x"
            )
        newest = values(
            api.series(templated(panels[104]["targets"][0]["expr"], range_s), launched, end)
        )
        if not newest or max(newest) > report["versions_committed"] or not all(map(whole, newest)):
            problems.append(f"newest version: {sorted(set(newest))[-3:]}")
        # Learners live: no drop to 0 while the run trains, from its first step to its last
        # commit, but for one reconnect. A replica's death ends no learner's lease; but a
        # slot has one session at a time, so a learner whose replica died is refused a new
        # one until the old one's lease lapses (10 s), and asks the replica that refused it
        # again each second: at most a few seconds of 0 (its retry, the replicas' reading of
        # Redis and the scrape, a second each) where every live learner sat on the dead one.
        steps = timeline(api, "sum(atoll_learner_steps_total)", launched, end)
        versions = timeline(api, "max(atoll_fragment_version)", launched, end)
        first_step = min(t for t, x in steps if x > 0)
        last_commit = max(
            t
            for (t, x), (_, before) in zip(versions[1:], versions[:-1], strict=True)
            if x != before
        )
        live = points(api, templated(panels[102]["targets"][0]["expr"], range_s), launched, end)
        training = [x for t, x in live if first_step <= t <= last_commit]
        zeros = "".join("0" if x == 0 else "." for x in training).split(".")
        if not training or max(map(len, zeros)) > RECONNECT_S:
            problems.append(f"learners live dropped to 0 while training: {training}")
        # Each time series panel, over the run.
        grace_counts = points(api, "sum(atoll_grace_window_seconds_count)", launched, end)
        if not grace_counts:
            problems.append("no atoll_grace_window_seconds_count was scraped")
        graced = any(x > 0 for _, x in grace_counts)
        for pid, panel in panels.items():
            if panel["type"] != "timeseries":
                continue
            for target in panel["targets"]:
                xs = values(api.series(templated(target["expr"], range_s), launched, end))
                problem = check_panel(pid, target["refId"], xs, report, graced)
                if problem:
                    problems.append(problem)

        # Alerts: what fired, against the faults injected.
        fired = firing(api, launched, watched)
        kill_at = {
            f["kind"]: launched + float(f["injected_at_s"]) for f in report["faults"]["schedule"]
        }
        assert set(kill_at) == {"learner-kill", "synchronizer-kill"}, report["faults"]
        for labels, first, _ in fired.get("AtollSynchronizerDown", []):
            if labels.get("slot") != "synchronizer-0" or first < kill_at["synchronizer-kill"]:
                problems.append(f"AtollSynchronizerDown without a fault: {labels} at {first}")
        if "AtollSynchronizerDown" not in fired:
            problems.append("the killed replica's absence did not fire AtollSynchronizerDown")
        if report["goodput"] < 0.7 and "AtollGoodputLow" not in fired:
            problems.append(f"goodput {report['goodput']} did not fire AtollGoodputLow")
        for name in ("AtollRedisUnreachable", "AtollLearnerFlapping", "AtollNoQuorum"):
            if name in fired:  # Redis never failed; one restart per slot; merges went on
                problems.append(f"{name} fired: {fired[name]}")
        pending = api.series('ALERTS{alertname="AtollRedisUnreachable"}', launched, watched)
        if pending:
            problems.append(f"AtollRedisUnreachable was pending: {pending[0]['metric']}")
        after = firing(api, end + SETTLE_S, watched)
        if after:
            problems.append(f"alerts firing after the run ended: {sorted(after)}")
        assert not problems, "\n".join(problems)
