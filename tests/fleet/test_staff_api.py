"""The staff REST API over pools, nodes, GPUs and replicas."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client

from serving.models import Node

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_user("ops", is_staff=True))
    return client


def test_a_non_staff_user_cannot_list_nodes(make_pool) -> None:
    client = Client()
    client.force_login(get_user_model().objects.create_user("dev"))
    assert client.get("/api/v1/nodes/").status_code == 403


def test_staff_cordon_a_node_through_the_api(staff, make_pool, register) -> None:
    _, secret = make_pool()
    node = register(secret, "gpu-1")
    response = staff.post(f"/api/v1/nodes/{node['node_id']}/cordon/")
    assert response.json()["status"] == "Cordoned"
    assert Node.objects.get(pk=node["node_id"]).scheduling == Node.Scheduling.CORDONED


def test_staff_list_a_nodes_gpus(staff, make_pool, register) -> None:
    _, secret = make_pool()
    node = register(secret, "gpu-1", gpus=3)
    response = staff.get("/api/v1/gpus/", {"limit": 10})
    assert [g["index"] for g in response.json()["results"] if g["node"] == node["node_id"]] == [
        0,
        1,
        2,
    ]


def test_the_demo_fleet_lists_one_agent_per_demo_node(
    gpu_classes, tmp_path, monkeypatch, capsys
) -> None:
    from serving import demo

    monkeypatch.setenv("PLATFORM_VAR_DIR", str(tmp_path))
    monkeypatch.setenv("PLATFORM_PUBLIC_URL", "http://cp.test:8000")
    details: dict = {"extra": {}}
    demo.seed(details)
    (tmp_path / "demo.json").write_text(json.dumps(details))
    call_command("demo_fleet", "--commands")
    agents = json.loads(capsys.readouterr().out)
    assert len(agents) == sum(p.nodes for p in demo.DEMO_POOLS)
    first = agents[0]["argv"]
    assert first[first.index("--control-plane") + 1] == "http://cp.test:8000"
    assert first[first.index("--token") + 1] == details["fleet"]["join_tokens"]["h100-us-east"]
