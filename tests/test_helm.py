"""The Helm chart, checked offline: strict lint; rendering with the Helm SDK for the default
values, every example overlay and every `helm install` / `helm upgrade` command that
docs/deploy.md and docs/security.md show, exactly as written; each manifest validated
against Kubernetes 1.29 to 1.32; bad values refused by the schema."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from services.codec import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "atoll"
HELM_DOCS = [ROOT / "docs" / "deploy.md", ROOT / "docs" / "security.md"]
OVERLAYS = sorted((CHART / "examples").glob("values-*.yaml"))
KUBE_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0"]
# CRDs (Prometheus operator, cert-manager): no upstream schema to validate against.
CRD_KINDS = {
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "PodMonitor": "monitoring.coreos.com/v1",
    "PrometheusRule": "monitoring.coreos.com/v1",
    "Certificate": "cert-manager.io/v1",
}


def render(
    values: dict[str, Any] | None = None, name: str = "atoll", namespace: str = "atoll"
) -> list[dict[str, Any]]:
    manifests = helm.Chart.load(CHART).render(values, name=name, namespace=namespace)
    docs: list[dict[str, Any]] = []
    for path, text in manifests.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def overlay(path: Path) -> dict[str, Any]:
    return dict(yaml.safe_load(path.read_text()))


def merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Helm's order: later values files and --set win, key by key; null stays (it deletes)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


@dataclass
class HelmCommand:
    """One `helm install` or `helm upgrade` line of the docs, as Helm would read it."""

    text: str
    doc: str = ""  # the page that shows it
    verb: str = ""
    release: str = ""
    namespace: str = "default"
    files: list[Path] = field(default_factory=list)
    sets: list[dict[str, Any]] = field(default_factory=list)
    reuse_values: bool = False

    @classmethod
    def parse(cls, text: str) -> HelmCommand:
        words = shlex.split(text)
        cmd = cls(text=text, verb=words[1])
        positional: list[str] = []
        parsers = {
            "--set": helm.parse_set_string,
            "--set-string": helm.parse_set_string_values,
            "--set-json": helm.parse_set_json,
        }
        rest = iter(words[2:])
        for word in rest:
            flag, _, inline = word.partition("=") if word.startswith("--") else (word, "", "")
            if flag in ("-n", "--namespace"):
                cmd.namespace = inline or next(rest)
            elif flag == "--kube-context":
                inline or next(rest)  # which cluster: nothing to render differently
            elif flag in ("-f", "--values"):
                cmd.files.append(ROOT / (inline or next(rest)))
            elif flag in parsers:
                cmd.sets.append(parsers[flag](inline or next(rest)))
            elif flag == "--reuse-values":
                cmd.reuse_values = True
            elif word.startswith("-"):
                raise AssertionError(f"{text!r}: {word} is not a flag this test knows; teach it")
            else:
                positional.append(word)
        assert len(positional) == 2, f"{text!r}: expected RELEASE CHART, got {positional}"
        cmd.release, chart = positional
        assert (ROOT / chart).resolve() == CHART, f"{text!r}: the chart is {chart}"
        return cmd


def documented_commands() -> list[HelmCommand]:
    """Every helm install/upgrade in the docs' sh blocks, continuation lines joined."""
    commands = []
    for doc in HELM_DOCS:
        for block in re.findall(r"```sh\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if re.match(r"\s*helm (install|upgrade) ", line):
                    commands.append(HelmCommand.parse(line.strip()))
                    commands[-1].doc = doc.name
    return commands


COMMANDS = documented_commands()


def render_commands() -> list[tuple[HelmCommand, list[dict[str, Any]]]]:
    """Each documented command's manifests, in the doc's order: an upgrade with
    --reuse-values starts from the values of that release's last install or upgrade."""
    released: dict[str, dict[str, Any]] = {}
    out = []
    for cmd in COMMANDS:
        values = dict(released.get(cmd.release, {})) if cmd.reuse_values else {}
        for layer in [overlay(f) for f in cmd.files] + cmd.sets:
            values = merged(values, layer)
        released[cmd.release] = values
        out.append((cmd, render(values, name=cmd.release, namespace=cmd.namespace)))
    return out


def validate(docs: list[dict[str, Any]], kube: str, release: str = "atoll") -> None:
    assert docs
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == CRD_KINDS[doc["kind"]]
            continue
        kubernetes_validate.validate(doc, kube, strict=True)
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "atoll"
        assert labels["app.kubernetes.io/instance"] == release


def containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in WORKLOADS]
    return [c for pod in pods for c in pod["containers"]]


WORKLOADS = {"Deployment", "StatefulSet"}


def test_the_chart_lints_strictly() -> None:
    report = helm.lint(CHART, strict=True, kube_version="v1.32.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems, report
    assert not report["errors"], report


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("values", [None, *OVERLAYS], ids=lambda v: getattr(v, "name", "default"))
def test_every_rendering_is_valid_kubernetes(values: Path | None, kube: str) -> None:
    validate(render(overlay(values) if values else None), kube)


def test_the_docs_show_installs_upgrades_and_the_pool_map() -> None:
    texts = [c.text for c in COMMANDS]
    assert {c.verb for c in COMMANDS} == {"install", "upgrade"}, texts
    assert {c.doc for c in COMMANDS} == {doc.name for doc in HELM_DOCS}
    assert any("--set 'learnerPools.main.replicas=4'" in t for t in texts), texts
    for overlay_file in OVERLAYS:
        assert any(overlay_file in c.files for c in COMMANDS), overlay_file.name


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_every_documented_command_renders_valid_kubernetes(kube: str) -> None:
    for cmd, docs in render_commands():
        try:
            validate(docs, kube, release=cmd.release)
        except Exception as e:
            raise AssertionError(f"{cmd.text}: {e}") from e


def test_the_documented_commands_do_what_the_docs_say() -> None:
    rendered = {cmd.text: docs for cmd, docs in render_commands()}
    single = next(docs for text, docs in rendered.items() if "learnerPools.main" in text)
    pool = next(d for d in single if d["metadata"]["name"] == "atoll-learner-main")
    assert pool["kind"] == "StatefulSet"
    assert pool["spec"]["replicas"] == 4
    assert "--num-shards=4" in pool["spec"]["template"]["spec"]["containers"][0]["args"]
    for replicas in (6, 3):  # the pool scaled while the job runs, its shards unchanged
        scaled = next(v for t, v in rendered.items() if f"us-central.replicas={replicas}'" in t)
        home = next(d for d in scaled if d["metadata"]["name"] == "atoll-learner-us-central")
        assert home["spec"]["replicas"] == replicas
        assert "--num-shards=16" in home["spec"]["template"]["spec"]["containers"][0]["args"]
    grown = next(docs for text, docs in rendered.items() if "eu-west.replicas=12" in text)
    eu = next(d for d in grown if d["kind"] == "StatefulSet")
    assert eu["metadata"]["name"] == "atoll-eu-learner-eu-west"
    assert eu["spec"]["replicas"] == 12
    assert "--num-shards=16" in eu["spec"]["template"]["spec"]["containers"][0]["args"]
    tls = next(docs for text, docs in rendered.items() if "tls.enabled=true" in text)
    certs = {d["metadata"]["name"]: d["spec"] for d in tls if d["kind"] == "Certificate"}
    assert set(certs) == {"atoll-synchronizer", "atoll-learner-us-central"}
    assert "atoll-synchronizer.us-central.example.com" in certs["atoll-synchronizer"]["dnsNames"]
    assert certs["atoll-synchronizer"]["issuerRef"]["kind"] == "ClusterIssuer"


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)


def test_defaults_give_synchronizers_a_pool_and_redis() -> None:
    docs = render()
    assert kinds(docs) == [
        "Deployment/atoll-synchronizer",
        "HorizontalPodAutoscaler/atoll-synchronizer",
        "NetworkPolicy/atoll-redis",
        "NetworkPolicy/atoll-synchronizer",
        "PersistentVolumeClaim/atoll-tensors",
        "PodDisruptionBudget/atoll-learner-main",
        "PodDisruptionBudget/atoll-synchronizer",
        "Secret/atoll-redis",
        "Service/atoll-learner-main",
        "Service/atoll-redis",
        "Service/atoll-synchronizer",
        "Service/atoll-synchronizer-headless",
        "ServiceAccount/atoll",
        "StatefulSet/atoll-learner-main",
        "StatefulSet/atoll-redis",
    ]
    sync = next(d for d in docs if d["kind"] == "Deployment")
    container = sync["spec"]["template"]["spec"]["containers"][0]
    # Readiness asks the service, which follows Redis; liveness asks the whole server, which
    # does not (a Redis outage must not restart every replica).
    assert container["readinessProbe"]["grpc"]["service"] == "atoll.v1.Synchronizer"
    assert container["livenessProbe"]["grpc"].get("service", "") == ""
    assert "--redis-url=redis://atoll-redis:6379/0" in container["args"]
    # Replicas share one tensor store (a ReadWriteMany claim by default) and advertise the
    # address learners send each owned fragment's updates to.
    assert "--tensor-store=/var/lib/atoll/tensors" in container["args"]
    assert "--advertise=$(POD_IP):50051" in container["args"]
    # The job's spec and first values come from the first pool's pod 0, not the first hello.
    assert "--initializer=atoll-learner-main-0" in container["args"]
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]  # see the tensor store's test
    bucket = render({"tensorStore": {"url": "s3://bucket/atoll"}})
    sync = next(d for d in bucket if d["kind"] == "Deployment")
    assert (
        "--tensor-store=s3://bucket/atoll"
        in sync["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert not [d for d in bucket if d["kind"] == "PersistentVolumeClaim"]
    learner = next(d for d in docs if d["metadata"]["name"] == "atoll-learner-main")
    args = learner["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--synchronizer=dns:///atoll-synchronizer-headless.atoll.svc:50051" in args


def test_a_learner_only_region_has_only_its_pool() -> None:
    docs = render(overlay(CHART / "examples" / "values-eu-west.yaml"))
    assert {d["kind"] for d in docs} == {
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
        "PodMonitor",
        "ServiceAccount",
    }
    pool = next(d for d in docs if d["kind"] == "StatefulSet")
    assert pool["metadata"]["name"] == "atoll-learner-eu-west"
    assert pool["spec"]["replicas"] == 8
    assert pool["spec"]["template"]["metadata"]["labels"]["atoll.dev/region"] == "eu-west"
    image = pool["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.startswith("registry.example.com/atoll@sha256:")


def test_pools_are_a_map_added_set_and_removed_by_name() -> None:
    docs = render(
        {
            "learnerPools": {
                "main": {"replicas": 3},
                "gpu": {
                    "replicas": 1,
                    "numShards": 4,
                    "resources": {"limits": {"nvidia.com/gpu": 8}},
                },
            }
        }
    )
    pools = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    assert pools["atoll-learner-main"]["spec"]["replicas"] == 3
    gpu = pools["atoll-learner-gpu"]["spec"]["template"]["spec"]["containers"][0]
    assert gpu["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert "--threads=4" in gpu["args"]  # what a new pool leaves out has a default
    pdbs = {d["metadata"]["name"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert {"atoll-learner-main", "atoll-learner-gpu"} <= pdbs
    gone = render({"learnerPools": {"main": None}})
    assert not [d for d in gone if d["metadata"]["name"].startswith("atoll-learner")]


def test_every_container_has_a_read_only_root_and_writable_volumes() -> None:
    docs = [d for v in [None, *OVERLAYS] for d in render(overlay(v) if v else None)]
    for c in containers(docs):
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
        assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}, c["name"]
    for d in docs:
        if d["kind"] in WORKLOADS:
            pod = d["spec"]["template"]["spec"]
            assert pod["automountServiceAccountToken"] is False, d["metadata"]["name"]


def test_the_redis_password_is_a_file_never_a_url_or_argument() -> None:
    for values in ({}, {"redis": {"password": "s3cret"}}):
        docs = render(values)
        secret = next(d for d in docs if d["kind"] == "Secret")
        assert list(secret["data"]) == ["password"]
        if values:
            assert secret["data"]["password"] == "czNjcmV0"  # base64 of s3cret
        text = yaml.safe_dump_all([d for d in docs if d["kind"] != "Secret"])
        assert "s3cret" not in text
        assert "REDIS_PASSWORD)" not in text
        sync = next(d for d in docs if d["kind"] == "Deployment")
        pod = sync["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert "--redis-url=redis://atoll-redis:6379/0" in container["args"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["ATOLL_REDIS_PASSWORD_FILE"] == "/etc/atoll/redis/password"
        mount = next(m for m in container["volumeMounts"] if m["name"] == "redis-password")
        assert mount["mountPath"] == "/etc/atoll/redis"
        volume = next(v for v in pod["volumes"] if v["name"] == "redis-password")
        assert volume["secret"]["secretName"] == "atoll-redis"
        redis = next(
            d for d in docs if d["metadata"]["name"] == "atoll-redis" and d["kind"] == "StatefulSet"
        )
        assert "requirepass" not in redis["spec"]["template"]["spec"]["containers"][0].get(
            "command", []
        )


def test_an_external_redis_takes_an_existing_secret_or_none() -> None:
    external = {"redis": {"url": "rediss://redis.internal:6379/0", "bundled": {"enabled": False}}}
    docs = render(merged(external, {"redis": {"existingSecret": "managed-redis"}}))
    assert not [d for d in docs if d["kind"] == "Secret"]
    sync = next(d for d in docs if d["kind"] == "Deployment")
    volume = next(
        v for v in sync["spec"]["template"]["spec"]["volumes"] if v["name"] == "redis-password"
    )
    assert volume["secret"]["secretName"] == "managed-redis"
    bare = next(d for d in render(external) if d["kind"] == "Deployment")
    env = {e["name"] for e in bare["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "ATOLL_REDIS_PASSWORD_FILE" not in env


def test_extension_points_reach_the_pods() -> None:
    extras: dict[str, Any] = {
        "podLabels": {"team": "research"},
        "podAnnotations": {"example.com/owner": "research"},
        "priorityClassName": "training",
        "nodeSelector": {"pool": "big"},
        "affinity": {"nodeAffinity": {}},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "DoNotSchedule",
            }
        ],
        "extraEnv": [{"name": "EXTRA", "value": "1"}],
        "extraVolumes": [{"name": "dataset", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": "dataset", "mountPath": "/data"}],
    }
    docs = render(
        {
            "podLabels": {"kueue.x-k8s.io/queue-name": "training"},
            "image": {"digest": "sha256:" + "a" * 64},
            "serviceAccount": {"create": False, "name": "trainer"},
            "synchronizer": extras,
            "learnerPools": {"main": extras},
        }
    )
    for kube in KUBE_VERSIONS:
        validate(docs, kube)
    for d in docs:
        if d["kind"] not in WORKLOADS or d["metadata"]["name"] == "atoll-redis":
            continue
        template = d["spec"]["template"]
        pod, container = template["spec"], template["spec"]["containers"][0]
        assert template["metadata"]["labels"]["team"] == "research"
        assert template["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "training"
        annotations = template["metadata"]["annotations"]
        assert annotations["example.com/owner"] == "research"
        assert annotations["prometheus.io/scrape"] == "true"  # the chart's own, kept
        assert pod["priorityClassName"] == "training"
        assert pod["serviceAccountName"] == "trainer"
        assert pod["nodeSelector"] == {"pool": "big"}
        assert pod["affinity"] == {"nodeAffinity": {}}
        assert pod["tolerations"] == extras["tolerations"]
        (spread,) = pod["topologySpreadConstraints"]
        assert spread["labelSelector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]
        assert {"name": "EXTRA", "value": "1"} in container["env"]
        assert {"name": "dataset", "emptyDir": {}} in pod["volumes"]
        assert {"name": "dataset", "mountPath": "/data"} in container["volumeMounts"]
        assert container["image"] == "atoll@sha256:" + "a" * 64
    assert "ServiceAccount" not in {d["kind"] for d in docs}


def test_tls_mounts_cert_manager_certificates() -> None:
    assert not [d for d in render() if d["kind"] == "Certificate"]
    docs = render({"tls": {"enabled": True, "issuerRef": {"name": "atoll-ca"}}})
    certs = {d["spec"]["secretName"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    assert certs["atoll-synchronizer-tls"]["usages"][0] == "server auth"
    assert "atoll-synchronizer-headless.atoll.svc" in certs["atoll-synchronizer-tls"]["dnsNames"]
    assert certs["atoll-learner-main-tls"]["usages"][0] == "client auth"
    for d in docs:
        if d["kind"] in WORKLOADS and d["metadata"]["name"] != "atoll-redis":
            pod = d["spec"]["template"]["spec"]
            (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls"]
            assert mount["mountPath"] == "/etc/atoll/tls"
            (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
            assert volume["secret"]["secretName"] in certs
            args = pod["containers"][0]["args"]
            assert "--tls-ca=/etc/atoll/tls/ca.crt" in args
            assert "--insecure" not in args
    assert certs["atoll-learner-main-tls"]["uris"] == ["learner:atoll-learner-main-*"]
    (sync,) = [
        d for d in docs if d["kind"] == "Deployment" and "synchronizer" in d["metadata"]["name"]
    ]
    container = sync["spec"]["template"]["spec"]["containers"][0]
    assert "--health-listen=0.0.0.0:50052" in container["args"]
    assert container["readinessProbe"]["grpc"]["port"] == 50052  # the kubelet speaks no TLS
    for d in render():
        if d["kind"] in WORKLOADS and d["metadata"]["name"] != "atoll-redis":
            assert "--insecure" in d["spec"]["template"]["spec"]["containers"][0]["args"]


def test_tls_takes_existing_secrets_instead_of_cert_manager() -> None:
    docs = render(
        {
            "tls": {"enabled": True, "existingSecret": "sync-certs"},
            "learnerPools": {"main": {"tlsSecret": "main-certs"}},
        }
    )
    assert not [d for d in docs if d["kind"] == "Certificate"]
    secrets = {}
    for d in docs:
        if d["kind"] in WORKLOADS and d["metadata"]["name"] != "atoll-redis":
            pod = d["spec"]["template"]["spec"]
            (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
            secrets[d["metadata"]["name"]] = volume["secret"]["secretName"]
            assert "--tls-cert=/etc/atoll/tls/tls.crt" in pod["containers"][0]["args"]
    assert secrets == {"atoll-synchronizer": "sync-certs", "atoll-learner-main": "main-certs"}
    # A pool with neither its Secret nor an issuer: the install says which and what to set.
    with pytest.raises(helm.HelmError, match=r"learnerPools\.main\.tlsSecret"):
        render({"tls": {"enabled": True, "existingSecret": "sync-certs"}})
    # cert-manager for the replicas, a Secret for one pool: only the others get a Certificate.
    docs = render(
        {
            "tls": {"enabled": True, "issuerRef": {"name": "ca"}},
            "learnerPools": {"main": {"tlsSecret": "main-certs"}},
        }
    )
    names = {d["spec"]["secretName"] for d in docs if d["kind"] == "Certificate"}
    assert names == {"atoll-synchronizer-tls"}


def pod_of(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (workload,) = [d for d in docs if d["kind"] in WORKLOADS and d["metadata"]["name"] == name]
    return dict(workload["spec"]["template"])


def test_learners_have_startup_and_liveness_probes_on_their_own_server() -> None:
    container = pod_of(render(), "atoll-learner-main")["spec"]["containers"][0]
    metrics = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
    assert "--metrics-listen=0.0.0.0:9410" in container["args"]
    assert metrics == 9410
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1800
    values = {"learnerPools": {"main": {"probes": {"enabled": False}}}}
    assert (
        "livenessProbe" not in pod_of(render(values), "atoll-learner-main")["spec"]["containers"][0]
    )


def test_the_tensor_store_default_binds_on_a_default_storage_class() -> None:
    docs = render()
    (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    # ReadWriteOnce, which every default storage class offers; no class named.
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "storageClassName" not in claim["spec"]
    # ... so the replicas share the node that mounts it.
    affinity = pod_of(docs, "atoll-synchronizer")["spec"]["affinity"]
    (term,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "synchronizer"
    # ReadWriteMany, object storage or a claim of one's own: spread over nodes.
    for values in (
        {"tensorStore": {"accessMode": "ReadWriteMany", "storageClassName": "nfs"}},
        {"tensorStore": {"url": "s3://bucket/atoll"}},
        {"tensorStore": {"existingClaim": "mine"}},
    ):
        docs = render(values)
        affinity = pod_of(docs, "atoll-synchronizer")["spec"]["affinity"]
        assert "podAffinity" not in affinity, values
        assert "podAntiAffinity" in affinity, values
    (claim,) = [
        d
        for d in render({"tensorStore": {"accessMode": "ReadWriteMany"}})
        if d["kind"] == "PersistentVolumeClaim"
    ]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_pods_carry_scrape_annotations_for_a_prometheus_without_the_operator() -> None:
    docs = render()
    for name, port in (("atoll-synchronizer", "9400"), ("atoll-learner-main", "9410")):
        meta = pod_of(docs, name)["metadata"]
        assert meta["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": port,
            "prometheus.io/path": "/metrics",
        }, name
        # What the documented relabelling reads: the training job and the component.
        assert meta["labels"]["atoll.dev/job"] == "atoll", name
        assert meta["labels"]["app.kubernetes.io/component"] in name, name
    docs = render({"monitoring": {"scrapeAnnotations": False}})
    assert "annotations" not in pod_of(docs, "atoll-synchronizer")["metadata"]


def test_scrape_labels_match_what_the_alert_rules_select() -> None:
    docs = render(overlay(CHART / "examples" / "values-home.yaml"))
    relabels = {
        d["kind"]: (d["spec"].get("endpoints") or d["spec"].get("podMetricsEndpoints"))[0][
            "relabelings"
        ]
        for d in docs
        if d["kind"] in ("ServiceMonitor", "PodMonitor")
    }
    jobs = set()
    for kind, rules in relabels.items():
        targets = {r["targetLabel"]: r for r in rules}
        jobs.add(targets["job"]["replacement"])
        assert targets["slot"]["sourceLabels"] == ["__meta_kubernetes_pod_name"], kind
        assert targets["region"]["sourceLabels"] == ["__meta_kubernetes_pod_label_atoll_dev_region"]
        # The training job, which the rules group by and the dashboard's variable selects.
        assert targets["atoll_job"]["replacement"] == "llm-7b", kind  # its job.name
    assert jobs == {"atoll-synchronizer", "atoll-learner"}
    assert relabels["PodMonitor"][-1] == {
        "sourceLabels": ["__meta_kubernetes_pod_label_atoll_dev_pool"],
        "targetLabel": "pool",
    }
    rules = next(d for d in docs if d["kind"] == "PrometheusRule")
    exprs = " ".join(r["expr"] for g in rules["spec"]["groups"] for r in g["rules"])
    selected = set(re.findall(r'\bjob="([^"]+)"', exprs))
    assert "by (atoll_job" in exprs
    assert selected, "the alert rules select no job"
    assert selected <= jobs


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"synchronizer": {"replicas": "three"}}, "replicas"),
        ({"synchronizer": {"replicaz": 3}}, "replicaz"),
        ({"job": {"mode": "eventual"}}, "mode"),
        ({"learnerPools": [{"name": "main", "replicas": 1, "numShards": 1}]}, "learnerPools"),
        ({"learnerPools": {"Bad_Name": {"replicas": 1, "numShards": 1}}}, "Bad_Name"),
        ({"learnerPools": {"ok": {"replicas": 1, "numShards": 1, "gpus": 8}}}, "gpus"),
        ({"learnerPools": {"ok": {"replicas": 1}}}, "numShards"),
        ({"learnerPools": {"main": {"resources": {"limits": {"nvidia.com/gpu": -1}}}}}, "gpu"),
        ({"image": {"digest": "latest"}}, "digest"),
        ({"redis": {"url": "http://redis:6379"}}, "url"),
        ({"redis": {"url": "redis://:hunter2@redis:6379/0"}}, "url"),
        ({"tls": {"enabled": True}}, "issuerRef"),
        ({"tensorStore": {"accessMode": "ReadWriteMost"}}, "accessMode"),
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
