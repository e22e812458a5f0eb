"""The Helm chart, checked offline: strict lint, rendering with the Helm SDK for the default
values and every example overlay, each manifest validated against Kubernetes 1.29 to 1.32,
and bad values refused by the schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from services.codec import REGISTRY

CHART = Path(__file__).resolve().parents[1] / "helm" / "atoll"
OVERLAYS = sorted((CHART / "examples").glob("values-*.yaml"))
KUBE_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0"]
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}  # CRDs: no upstream schema


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    manifests = helm.Chart.load(CHART).render(values, name="atoll", namespace="atoll")
    docs: list[dict[str, Any]] = []
    for path, text in manifests.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def overlay(path: Path) -> dict[str, Any]:
    return dict(yaml.safe_load(path.read_text()))


def test_the_chart_lints_strictly() -> None:
    report = helm.lint(CHART, strict=True, kube_version="v1.32.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems, report
    assert not report["errors"], report


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("values", [None, *OVERLAYS], ids=lambda v: getattr(v, "name", "default"))
def test_every_rendering_is_valid_kubernetes(values: Path | None, kube: str) -> None:
    docs = render(overlay(values) if values else None)
    assert docs
    for doc in docs:
        if doc["kind"] in OPERATOR_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(doc, kube, strict=True)
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "atoll"
        assert labels["app.kubernetes.io/instance"] == "atoll"


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)


def test_defaults_give_synchronizers_a_pool_and_redis() -> None:
    docs = render()
    assert kinds(docs) == [
        "Deployment/atoll-synchronizer",
        "HorizontalPodAutoscaler/atoll-synchronizer",
        "NetworkPolicy/atoll-redis",
        "NetworkPolicy/atoll-synchronizer",
        "PodDisruptionBudget/atoll-synchronizer",
        "Service/atoll-learner-local",
        "Service/atoll-redis",
        "Service/atoll-synchronizer",
        "Service/atoll-synchronizer-headless",
        "StatefulSet/atoll-learner-local",
        "StatefulSet/atoll-redis",
    ]
    sync = next(d for d in docs if d["kind"] == "Deployment")
    container = sync["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"]["service"] == "atoll.v1.Synchronizer"
    assert "--redis-url=redis://atoll-redis:6379/0" in container["args"]
    learner = next(d for d in docs if d["metadata"]["name"] == "atoll-learner-local")
    args = learner["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--synchronizer=dns:///atoll-synchronizer-headless.atoll.svc:50051" in args


def test_a_learner_only_region_has_only_its_pool() -> None:
    docs = render(overlay(CHART / "examples" / "values-eu-west.yaml"))
    assert {d["kind"] for d in docs} == {"StatefulSet", "Service", "PodMonitor"}
    pool = next(d for d in docs if d["kind"] == "StatefulSet")
    assert pool["spec"]["replicas"] == 8
    assert pool["spec"]["template"]["metadata"]["labels"]["atoll.dev/region"] == "eu-west"


def test_a_redis_password_reaches_the_url_through_a_secret() -> None:
    docs = render({"redis": {"password": "s3cret"}})
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert secret["stringData"] == {"password": "s3cret"}
    sync = next(d for d in docs if d["kind"] == "Deployment")
    container = sync["spec"]["template"]["spec"]["containers"][0]
    assert "--redis-url=redis://:$(REDIS_PASSWORD)@atoll-redis:6379/0" in container["args"]


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"synchronizer": {"replicas": "three"}}, "replicas"),
        ({"synchronizer": {"replicaz": 3}}, "replicaz"),
        ({"job": {"mode": "eventual"}}, "mode"),
        ({"learnerPools": [{"name": "Bad_Name", "replicas": 1, "numShards": 1}]}, "name"),
        ({"learnerPools": [{"name": "ok", "replicas": 1, "numShards": 1, "gpus": 8}]}, "gpus"),
        ({"redis": {"url": "http://redis:6379"}}, "url"),
    ],
)
def test_bad_values_are_refused_by_the_schema(values: dict[str, Any], match: str) -> None:
    with pytest.raises(helm.HelmError, match=match):
        helm.Chart.load(CHART).render(values, name="atoll", namespace="atoll")


def test_the_schema_offers_exactly_the_codecs_atoll_has() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    offered = schema["properties"]["job"]["properties"]["codec"]["enum"]
    assert sorted(offered) == sorted(REGISTRY)
    sync = next(d for d in render({"job": {"codec": "sign"}}) if d["kind"] == "Deployment")
    args = sync["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--codec=sign" in args
