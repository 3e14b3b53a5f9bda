"""platform/kubernetes/networkpolicy.yaml against the workloads it guards: every selector names
pods the manifests run, ingress is denied by default, and the engine and agent ports are open
to the gateways and the control plane only. The README's nftables rules say the same."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "platform" / "kubernetes"
README = ROOT / "platform" / "README.md"

AGENT_PORT = 9100
GATEWAY_PORT = 8000
# The kernel's default ephemeral range, where the agent's engines take their ports.
ENGINE_PORTS = (32768, 60999)
CONTROL_PLANE = {"gateway", "celery-worker-realtime", "celery-worker-batch"}


def _objects() -> list[dict[str, Any]]:
    return [
        doc
        for path in sorted(KUBERNETES.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _policies() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _objects() if d.get("kind") == "NetworkPolicy"}


def _workload_labels() -> dict[str, dict[str, str]]:
    """The pod labels of each Deployment, DaemonSet and Job, by workload name."""
    return {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in _objects()
        if d.get("kind") in {"Deployment", "DaemonSet", "StatefulSet", "Job"}
    }


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _in_namespace(peer: dict[str, Any]) -> set[str]:
    """The workloads of this namespace a `from` peer admits (none for another namespace's)."""
    if "namespaceSelector" in peer or "podSelector" not in peer:
        return set()
    return {
        name for name, labels in _workload_labels().items() if _selects(peer["podSelector"], labels)
    }


def _rules_for(workload: str) -> list[dict[str, Any]]:
    labels = _workload_labels()[workload]
    return [
        rule
        for policy in _policies().values()
        if _selects(policy["spec"]["podSelector"], labels)
        for rule in policy["spec"].get("ingress", [])
    ]


def _covers(rule: dict[str, Any], low: int, high: int) -> bool:
    return any(
        p.get("protocol", "TCP") == "TCP"
        and p["port"] <= low
        and p.get("endPort", p["port"]) >= high
        for p in rule.get("ports", [])
    )


def _admitted(workload: str, low: int, high: int | None = None) -> tuple[set[str], list[Any]]:
    """Workloads of the namespace let in on ports low..high, and the outside peers."""
    inside: set[str] = set()
    outside: list[Any] = []
    for rule in _rules_for(workload):
        if not _covers(rule, low, high or low):
            continue
        assert rule.get("from"), f"a rule on {workload} admits every source"
        for peer in rule["from"]:
            inside |= _in_namespace(peer)
            if "namespaceSelector" in peer:
                outside.append(peer)
    return inside, outside


def test_the_kustomization_applies_the_network_policies() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    assert "networkpolicy.yaml" in kustomization["resources"]


def test_ingress_is_denied_by_default_in_the_namespace() -> None:
    deny = [
        p["spec"]
        for p in _policies().values()
        if p["spec"]["podSelector"] == {} and "Ingress" in p["spec"]["policyTypes"]
    ]
    assert deny and all(not spec.get("ingress") for spec in deny)


def test_every_policy_and_every_peer_in_the_namespace_selects_pods_that_run() -> None:
    labels = _workload_labels()
    for name, policy in _policies().items():
        selector = policy["spec"]["podSelector"]
        assert selector == {} or any(_selects(selector, lb) for lb in labels.values()), name
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    assert _in_namespace(peer), f"{name}: {peer} selects no workload"


def test_the_agents_api_is_reachable_from_the_control_plane_only() -> None:
    inside, outside = _admitted("node-agent", AGENT_PORT)
    assert inside == CONTROL_PLANE
    assert outside == []


def test_engine_ports_are_reachable_from_gateways_and_prometheus_only() -> None:
    inside, outside = _admitted("node-agent", *ENGINE_PORTS)
    assert inside == {"gateway"}
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in outside] == [
        "prometheus"
    ]


def test_the_gateway_is_reachable_from_the_ingress_controller_and_prometheus() -> None:
    inside, outside = _admitted("gateway", GATEWAY_PORT)
    names = sorted(p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in outside)
    assert (inside, names) == (set(), ["ingress-nginx", "prometheus"])
    container_ports = {
        p["containerPort"]
        for d in _objects()
        if d.get("kind") == "Deployment" and d["metadata"]["name"] == "gateway"
        for c in d["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    assert GATEWAY_PORT in container_ports


def test_no_policy_opens_the_celery_workers_or_the_migrate_job() -> None:
    for workload in ("celery-worker-realtime", "celery-worker-batch", "celery-beat", "migrate"):
        if workload in _workload_labels():
            assert _rules_for(workload) == [], workload


def test_the_node_agent_listens_on_the_port_the_policy_opens() -> None:
    agent = next(
        d
        for d in _objects()
        if d.get("kind") == "DaemonSet" and d["metadata"]["name"] == "node-agent"
    )
    container = agent["spec"]["template"]["spec"]["containers"][0]
    assert f"--listen=0.0.0.0:{AGENT_PORT}" in container["command"]


def test_the_readmes_node_firewall_guards_the_same_ports() -> None:
    nft = re.search(r"```nft\n(.*?)```", README.read_text(), re.S)
    assert nft is not None
    rules = nft.group(1)
    low, high = ENGINE_PORTS
    for port, allowed in ((str(AGENT_PORT), ["@control_plane"]), (f"{low}-{high}", ["@gateways"])):
        for source in allowed:
            assert f"tcp dport {port} ip saddr {source} accept" in rules
        assert f"tcp dport {port} drop" in rules
        # Every accept for the port comes before its drop.
        assert rules.index(f"tcp dport {port} drop") > rules.rindex(f"tcp dport {port} ip saddr")
