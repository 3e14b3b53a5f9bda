"""The deployment files under platform/ parse and name only what the code really has.

Alerts and dashboards that query a metric nobody exports stay silent forever, and an env file
that lists a variable nothing reads misleads whoever deploys; these tests catch both.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics_core import Metric

from serving.enginesim.metrics import EngineMetrics

ROOT = Path(__file__).resolve().parents[2]
PLATFORM = ROOT / "platform"
KUBERNETES = PLATFORM / "kubernetes"
ALERTS = PLATFORM / "prometheus" / "alerts.yaml"
DASHBOARD = PLATFORM / "grafana" / "platform-overview.json"
ENV_EXAMPLE = PLATFORM / "env.example"

# The Python packages that define the platform's own Prometheus metrics.
METRIC_SOURCES = ("serving", "tenants", "metering", "registry", "config")
METRIC_NAME = re.compile(r"\b(platform_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
DEFINED_PLATFORM_METRIC = re.compile(r"""["'](platform_[a-z0-9_]+)["']""")
# Series a histogram or counter family exposes beyond its own name.
SAMPLE_SUFFIXES = ("_bucket", "_count", "_sum", "_created")
ENV_ASSIGNMENT = re.compile(r"^([A-Z][A-Z0-9_]*)=", re.MULTILINE)
SETTINGS_ENV_READ = re.compile(r"""env_(?:str|bool|int|float|list|url)\(\s*["']([A-Z0-9_]+)["']""")


def yaml_files() -> list[Path]:
    return sorted([*PLATFORM.rglob("*.yaml"), *PLATFORM.rglob("*.yml")])


def documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def python_files(*packages: str) -> Iterator[Path]:
    for package in packages:
        yield from (ROOT / package).rglob("*.py")


def family_name(series: str) -> str:
    """The metric family a series belongs to, as prometheus_client names it."""
    for suffix in SAMPLE_SUFFIXES:
        if series.endswith(suffix):
            series = series.removesuffix(suffix)
            break
    return series.removesuffix("_total")


def exported_families() -> set[str]:
    platform_names = {
        name
        for path in python_files(*METRIC_SOURCES)
        for name in DEFINED_PLATFORM_METRIC.findall(path.read_text())
    }
    engine = EngineMetrics("any-model", max_loras=1)
    engine_families: list[Metric] = list(engine.registry.collect())
    return {family_name(name) for name in platform_names} | {
        family_name(family.name) for family in engine_families
    }


def alert_expressions() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    variables = [
        variable["query"]["query"]
        for variable in dashboard["templating"]["list"]
        if isinstance(variable.get("query"), dict)
    ]
    return queries + variables


def kubernetes_objects() -> list[dict[str, Any]]:
    return [doc for path in sorted(KUBERNETES.glob("*.yaml")) for doc in documents(path)]


def find_object(kind: str, name: str) -> dict[str, Any]:
    matches = [
        doc
        for doc in kubernetes_objects()
        if doc.get("kind") == kind and doc.get("metadata", {}).get("name") == name
    ]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def env_example_names() -> list[str]:
    return ENV_ASSIGNMENT.findall(ENV_EXAMPLE.read_text())


def variables_the_settings_read() -> set[str]:
    return set(SETTINGS_ENV_READ.findall((ROOT / "config" / "settings.py").read_text()))


def test_platform_holds_no_python_file() -> None:
    assert not list(PLATFORM.rglob("*.py"))


@pytest.mark.parametrize("path", yaml_files(), ids=lambda path: str(path.relative_to(PLATFORM)))
def test_every_yaml_file_parses(path: Path) -> None:
    assert documents(path), f"{path} holds no YAML document"


def test_the_grafana_dashboard_is_a_dashboard_model_with_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    assert all(panel["type"] == "row" or panel["targets"] for panel in dashboard["panels"])


def test_every_alert_rule_has_a_name_an_expression_and_a_severity() -> None:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert rules
    for rule in rules:
        assert rule["alert"] and rule["expr"].strip() and rule["labels"]["severity"], rule


@pytest.mark.parametrize(
    "source, expressions",
    [("alerts", alert_expressions), ("dashboard", dashboard_expressions)],
)
def test_every_metric_queried_is_exported_by_the_code(source: str, expressions: Any) -> None:
    exported = exported_families()
    used = {name for expr in expressions() for name in METRIC_NAME.findall(expr)}
    assert used, f"the {source} query no metric"
    unknown = sorted(name for name in used if family_name(name) not in exported)
    assert not unknown, f"the {source} query metrics nothing exports: {unknown}"


def test_every_variable_in_env_example_is_read_by_config_or_scripts() -> None:
    sources = "\n".join(path.read_text() for path in python_files("config", "scripts"))
    unread = [
        name
        for name in env_example_names()
        if f'"{name}"' not in sources and f"'{name}'" not in sources
    ]
    assert env_example_names()
    assert not unread, f"env.example lists variables nothing reads: {unread}"


def test_env_example_lists_every_variable_the_settings_read() -> None:
    missing = variables_the_settings_read() - set(env_example_names())
    assert not missing, f"env.example lacks {sorted(missing)}"


def test_the_configmap_and_secret_carry_every_variable_the_settings_read() -> None:
    configmap = find_object("ConfigMap", "platform-settings")["data"]
    secret = find_object("Secret", "platform-secrets")["stringData"]
    missing = variables_the_settings_read() - set(configmap) - set(secret)
    assert not missing, f"neither the ConfigMap nor the Secret sets {sorted(missing)}"


def test_kustomization_lists_only_files_that_exist() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    missing = [name for name in kustomization["resources"] if not (KUBERNETES / name).exists()]
    assert not missing


def test_celery_beat_runs_exactly_once_even_during_a_rollout() -> None:
    beat = find_object("Deployment", "celery-beat")["spec"]
    assert (beat["replicas"], beat["strategy"]["type"]) == (1, "Recreate")


def test_the_gateway_probes_readiness_and_liveness_on_the_health_endpoints() -> None:
    container = find_object("Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    probed = (
        container["readinessProbe"]["httpGet"]["path"],
        container["livenessProbe"]["httpGet"]["path"],
    )
    assert probed == ("/readyz/gateway", "/healthz")


def test_the_node_agent_takes_its_join_token_from_a_secret() -> None:
    agent = find_object("DaemonSet", "node-agent")["spec"]["template"]["spec"]["containers"][0]
    token = next(item for item in agent["env"] if item["name"] == "NODE_AGENT_JOIN_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == "node-agent-join"
