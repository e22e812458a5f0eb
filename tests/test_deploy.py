"""Dashboards, alert rules and the compose stack use only metrics atoll really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from services import telemetry

ROOT = Path(__file__).resolve().parents[1]
FILES = ROOT / "helm" / "atoll" / "files"
METRIC = re.compile(r"\batoll_[a-z0-9_]+")


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
    used = {m for expr in queries() for m in METRIC.findall(expr)}
    assert used, "no atoll metric found in the dashboards and alerts"
    unknown = sorted(used - names)
    assert not unknown, f"not exported by atoll: {unknown}"


def test_the_dashboard_covers_what_operators_watch() -> None:
    used = {m for expr in queries() for m in METRIC.findall(expr)}
    for needed in (
        "atoll_goodput_seconds_total",
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
