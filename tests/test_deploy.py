"""Dashboards, alert rules and the compose stack use only metrics atoll really exports; the
image's health check works."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services import telemetry

ROOT = Path(__file__).resolve().parents[1]
FILES = ROOT / "helm" / "atoll" / "files"
# A name with atoll's prefix, not followed by a label matcher's operator: `atoll_job` is the
# training job's label, which queries select on and group by.
METRIC = re.compile(r"\batoll_[a-z0-9_]+\b(?!\s*(=|!=|=~|!~))")
LABELS = {"atoll_job"}


SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def exported() -> set[str]:
    """Every series name atoll's role registries can expose (labelled ones before any label
    is set)."""
    names: set[str] = set()
    for registry in telemetry.REGISTRIES.values():
        for family in registry.collect():
            names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
    return names


def queries() -> list[str]:
    dashboard = json.loads((FILES / "atoll-goodput.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    rules = yaml.safe_load((FILES / "alerts.yaml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    return exprs


def test_every_panel_and_alert_uses_exported_metrics() -> None:
    names = exported()
    used = {m.group(0) for expr in queries() for m in METRIC.finditer(expr)} - LABELS
    assert used, "no atoll metric found in the dashboards and alerts"
    unknown = sorted(used - names)
    assert not unknown, f"not exported by atoll: {unknown}"


def test_the_dashboard_covers_what_operators_watch() -> None:
    used = {m.group(0) for expr in queries() for m in METRIC.finditer(expr)} - LABELS
    for needed in (
        "atoll_goodput_seconds_total",
        "atoll_job_useful_seconds_total",
        "atoll_job_updates_accepted_total",
        "atoll_job_learners_live",
        "atoll_badput_seconds_total",
        "atoll_provisioned_seconds_total",
        "atoll_learner_tokens_total",
        "atoll_merge_quorum_size_bucket",
        "atoll_grace_window_seconds_bucket",
        "atoll_update_staleness_versions_bucket",
        "atoll_learner_bytes_total",
        "atoll_learner_eval_loss",
        "atoll_fragment_version",
        "atoll_redis_up",
    ):
        assert needed in used, needed


def test_the_compose_stack_binds_loopback_only_and_mounts_what_exists() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        assert service.get("network_mode") == "host", name
        assert "ports" not in service, name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / "deploy" / source).resolve().exists(), (name, source)
    text = (ROOT / "deploy" / "compose.yaml").read_text()
    assert "0.0.0.0" not in text


def test_the_image_healthcheck_asks_a_synchronizer_and_passes_a_learner(tmp_path: Path) -> None:
    """The Dockerfile's HEALTHCHECK script, run against a health server, with the
    container's first process (/proc/1/cmdline) replaced by a file."""
    line = next(
        x
        for x in (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
        if x.startswith("HEALTHCHECK")
    )
    script = json.loads(line[line.index(" CMD ") + 5 :])[2]
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def check(*argv: str) -> int:
        cmdline = tmp_path / "cmdline"
        cmdline.write_bytes("\0".join(["/opt/atoll/bin/python", "atoll", *argv, ""]).encode())
        run = script.replace("/proc/1/cmdline", str(cmdline))
        return subprocess.run(
            [sys.executable, "-c", run], capture_output=True, timeout=30
        ).returncode

    try:
        assert check("learner", "--id", "a") == 0
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert check("synchronizer", f"--listen=0.0.0.0:{port}") == 0
        assert check("synchronizer", "--listen", f"127.0.0.1:{port}") == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert check("synchronizer", f"--listen=0.0.0.0:{port}") == 1
    finally:
        server.stop(0)
    assert check("synchronizer", f"--listen=127.0.0.1:{port}") == 1
