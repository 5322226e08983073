"""deploy/prometheus/alerts.yml: valid for promtool, unit-tested by promtool, over real metric names, with runbooks."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamtrain.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / "deploy" / "prometheus"
OPERATIONS = (REPO / "docs" / "operations.md").read_text()

#: What the production-Kafka issue asks to be paged on, one alert each.
WANTED = {
    "StreamtrainIngestStalled", "StreamtrainConsumerLagGrowing", "StreamtrainNoModelPublished",
    "StreamtrainPrequentialSkillNegative", "StreamtrainDriftDetected", "StreamtrainCheckpointFailing",
    "StreamtrainDeadLettersPending", "StreamtrainDpEpsilonNearCap", "StreamtrainKafkaSecurityFailing",
}  # fmt: skip


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail(
            "promtool not found: install Debian's prometheus package (apt-get install prometheus; .ci/run does)"
        )
    return subprocess.run([binary, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", "alerts.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_pass() -> None:
    done = promtool("test", "rules", "alerts.test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_wanted_alert_exists_and_is_unit_tested() -> None:
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert alerts == WANTED, alerts ^ WANTED
    tested = set(re.findall(r"alertname: (\w+)", (PROMETHEUS / "alerts.test.yml").read_text()))
    assert tested == WANTED, WANTED - tested


def _headings() -> set[str]:
    """GitHub's anchors of docs/operations.md's headings."""
    return {re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in OPERATIONS.splitlines() if line.startswith("#")}  # fmt: skip


def test_every_alert_has_a_summary_and_a_runbook_section() -> None:
    anchors = _headings()
    for rule in rules():
        if "alert" not in rule:
            continue
        annotations = rule["annotations"]
        assert annotations["summary"].strip(), rule["alert"]
        path, _, anchor = annotations["runbook_url"].partition("#")
        assert path == "docs/operations.md" and anchor in anchors, f"{rule['alert']}: no section #{anchor} in {path}"


def exported_series() -> set[str]:
    metrics = Metrics()
    metrics.watch_window_age(lambda: (0.0, 0.0))
    metrics.watch_models(lambda: ([1], 1, 0.0))
    names = set()
    for family in metrics.registry.collect():
        for sample in family.samples:
            names.add(sample.name)
        if family.type in ("gauge", "histogram", "info", "stateset"):
            names.add(family.name)
    return names


def test_rules_use_only_metrics_the_service_exports() -> None:
    exported = exported_series()
    used = set()
    for rule in rules():
        used |= set(re.findall(r"\bstreamtrain_[a-z0-9_]+", rule["expr"]))
    assert used, "the rules read no streamtrain metric"
    assert used <= exported, used - exported


def test_prometheus_loads_the_rules() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())
    assert "./prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in compose["services"]["prometheus"]["volumes"]


K8S_RULE = REPO / "deploy" / "k8s-monitoring" / "prometheus-rule.yaml"
K8S_RULE_HEAD = (
    "# deploy/prometheus/alerts.yml as a PrometheusRule for the Prometheus operator (kube-prometheus-stack).\n"
    "# Same groups, rule for rule (tests/unit/test_alerts.py checks it): edit alerts.yml, then regenerate\n"
    "# this file with `.venv/bin/python tests/unit/test_alerts.py`.\n"
    "# Its `release` label must match your Prometheus's ruleSelector (kube-prometheus-stack: the release name).\n"
)


def prometheus_rule() -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "streamtrain",
            "labels": {"app.kubernetes.io/name": "streamtrain", "release": "prometheus"},
        },
        "spec": {"groups": yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]},
    }


def test_the_k8s_prometheus_rule_is_alerts_yml() -> None:
    assert yaml.safe_load(K8S_RULE.read_text()) == prometheus_rule(), (
        "regenerate: .venv/bin/python tests/unit/test_alerts.py"
    )
    kustomization = yaml.safe_load((K8S_RULE.parent / "kustomization.yaml").read_text())
    assert kustomization["resources"] == [K8S_RULE.name]


if __name__ == "__main__":  # regenerate the PrometheusRule from alerts.yml
    K8S_RULE.write_text(K8S_RULE_HEAD + yaml.safe_dump(prometheus_rule(), sort_keys=False, width=200))
    sys.exit(0)
