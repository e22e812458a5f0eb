"""atoll's alert rules: unit-tested with `promtool test rules` (the Debian package prometheus,
which CI installs), each alert tested and linked to its runbook in docs/operations.md."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "helm" / "atoll" / "files" / "alerts.yaml"
RULE_TESTS = ROOT / "tests" / "promtool" / "alerts_test.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
RUNBOOKS = "https://github.com/atoll-project/atoll/blob/main/docs/operations.md#"


def alerts() -> list[dict[str, object]]:
    rules = yaml.safe_load(RULES.read_text())
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def promtool(*args: str) -> None:
    exe = shutil.which("promtool")
    assert exe is not None, "no promtool on PATH: install the Debian package prometheus"
    done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rules_are_valid() -> None:
    promtool("check", "rules", str(RULES))


def test_the_rules_pass_their_unit_tests() -> None:
    promtool("test", "rules", str(RULE_TESTS))


def test_every_alert_has_unit_tests() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    tested = {
        case["alertname"]
        for group in tests
        for case in group["alert_rule_test"]
        if case["exp_alerts"]  # one case at least where it fires
    }
    assert {a["alert"] for a in alerts()} <= tested


def test_every_alert_links_its_runbook() -> None:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    headings = re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), re.M)
    anchors = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
    for alert in alerts():
        annotations = alert["annotations"]
        assert isinstance(annotations, dict)
        url = annotations["runbook_url"]
        assert url.startswith(RUNBOOKS), (alert["alert"], url)
        assert url.removeprefix(RUNBOOKS) in anchors, (alert["alert"], url)
