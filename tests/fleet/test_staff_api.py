"""The staff REST API over pools, nodes, GPUs and replicas: staff by session; API keys are
authenticated as on the rest of /api/v1/ and refused, since a key is never staff."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.test import Client

from config.jobs import Enqueue
from serving.actions import pools
from serving.models import GpuClass, GpuPool, Node
from tenants.actions import do_create_api_key, do_create_tenant, do_revoke_api_key
from tenants.models import ApiKey

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
    gpu_classes, tmp_path, settings, capsys
) -> None:
    from serving import demo

    settings.PLATFORM_VAR_DIR = tmp_path
    settings.PLATFORM_PUBLIC_URL = "http://cp.test:8000"
    details: dict = {"extra": {}}
    demo.seed(details)
    (tmp_path / "demo.json").write_text(json.dumps(details))
    call_command("demo_fleet", "--commands")
    agents = json.loads(capsys.readouterr().out)
    assert len(agents) == sum(p.nodes for p in demo.DEMO_POOLS)
    first = agents[0]["argv"]
    assert first[first.index("--control-plane") + 1] == "http://cp.test:8000"
    assert first[first.index("--token") + 1] == details["fleet"]["join_tokens"]["h100-us-east"]


# ------------------------------------------------------------------- API keys


STAFF_ROUTES = ["/api/v1/pools/", "/api/v1/nodes/", "/api/v1/gpus/", "/api/v1/replicas/"]


def key_client(raw_key: str) -> Client:
    return Client(headers={"authorization": f"Bearer {raw_key}"})


@pytest.fixture
def acme_key(db: None) -> Any:
    """Mint an acme key as a staff member would: what made it does not make it staff."""
    acme = do_create_tenant("acme", "Acme")
    creator = get_user_model().objects.create_user("key-minter", is_staff=True)

    def mint(*scopes: str) -> str:
        return do_create_api_key(acme, "automation", creator, list(scopes))[1]

    return mint


@pytest.mark.parametrize("route", STAFF_ROUTES)
def test_a_tenants_manage_key_is_authenticated_then_refused_as_not_staff(
    route: str, acme_key: Any
) -> None:
    response = key_client(acme_key("manage")).get(route)
    assert response.status_code == 403
    # Signed in, not staff: a route that ignored keys would say no credentials were given.
    assert response.json() == {"detail": "You do not have permission to perform this action."}


def test_a_manage_key_cannot_create_a_pool(gpu_classes: None, acme_key: Any) -> None:
    response = key_client(acme_key("manage", "read_usage")).post(
        "/api/v1/pools/",
        {"name": "by-key", "gpu_class": "L4-24GB", "region": "eu-west"},
        content_type="application/json",
    )
    assert response.status_code == 403
    assert not GpuPool.objects.filter(name="by-key").exists()


def test_an_inference_key_and_a_revoked_key_are_refused_by_the_key_check(acme_key: Any) -> None:
    inference = key_client(acme_key("inference")).get("/api/v1/nodes/")
    assert inference.status_code == 403
    assert inference.json() == {"detail": "This key has no manage or read_usage scope."}
    raw = acme_key("manage")
    minter = get_user_model().objects.get(username="key-minter")
    do_revoke_api_key(ApiKey.objects.get(prefix=raw.split("-")[1]), minter)
    revoked = key_client(raw).get("/api/v1/nodes/")
    assert revoked.status_code == 403
    assert revoked.json() == {"detail": "Invalid API key."}


def test_without_credentials_the_fleet_api_answers_403_as_before(db: None) -> None:
    response = Client().get("/api/v1/pools/")
    assert response.status_code == 403
    assert response.json() == {"detail": "Authentication credentials were not provided."}


# ------------------------------------------------------------------- pools


def test_staff_create_a_pool_and_get_it_back(staff: Client, gpu_classes: None) -> None:
    response = staff.post(
        "/api/v1/pools/",
        {"name": "h200-us", "gpu_class": "H200-SXM-141GB", "region": "us-east", "spot": True},
        content_type="application/json",
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    pool = GpuPool.objects.get(pk=body["id"])
    assert (pool.gpu_class.name, pool.region, pool.spot, pool.usd_per_gpu_hour) == (
        "H200-SXM-141GB",
        "us-east",
        True,
        None,
    )
    assert body["price_per_gpu_hour"] == f"{pool.gpu_class.default_usd_per_hour:.4f}"


def test_a_pool_with_a_bad_name_class_or_price_is_a_400_naming_each(
    staff: Client, gpu_classes: None
) -> None:
    response = staff.post(
        "/api/v1/pools/",
        {"name": "x y", "gpu_class": "nope", "region": "r", "usd_per_gpu_hour": "-1"},
        content_type="application/json",
    )
    assert response.status_code == 400
    assert set(response.json()) == {"name", "gpu_class", "usd_per_gpu_hour"}
    assert not GpuPool.objects.exists()


def test_a_price_change_over_the_api_republishes_the_routing_table(
    staff: Client, make_pool: Any, django_capture_on_commit_callbacks: Any
) -> None:
    pool, _ = make_pool()
    with django_capture_on_commit_callbacks() as on_commit:
        response = staff.patch(
            f"/api/v1/pools/{pool.pk}/",
            {"usd_per_gpu_hour": "0.6500"},
            content_type="application/json",
        )
    assert response.status_code == 200
    assert response.json()["price_per_gpu_hour"] == "0.6500"
    assert GpuPool.objects.get(pk=pool.pk).usd_per_gpu_hour == Decimal("0.6500")
    assert on_commit == [Enqueue("serving.publish_routing_table")]


def test_a_label_change_leaves_the_routing_table_alone(
    make_pool: Any, django_capture_on_commit_callbacks: Any
) -> None:
    pool, _ = make_pool()
    with django_capture_on_commit_callbacks() as on_commit:
        pools.do_update_pool(pool, labels={"team": "ml"})
    assert GpuPool.objects.get(pk=pool.pk).labels == {"team": "ml"}
    assert on_commit == []


def test_staff_delete_an_empty_pool(staff: Client, make_pool: Any) -> None:
    pool, _ = make_pool()
    assert staff.delete(f"/api/v1/pools/{pool.pk}/").status_code == 204
    assert not GpuPool.objects.filter(pk=pool.pk).exists()


def test_a_pool_with_a_node_is_not_deleted_and_the_400_says_why(
    staff: Client, make_pool: Any, register: Any
) -> None:
    pool, secret = make_pool()
    register(secret, "gpu-1")
    response = staff.delete(f"/api/v1/pools/{pool.pk}/")
    assert response.status_code == 400
    assert response.json() == ["This pool still has 1 node; remove them first."]
    assert GpuPool.objects.filter(pk=pool.pk).exists()


def test_a_pool_holding_deployments_is_not_deleted(make_pool: Any, make_deployment: Any) -> None:
    pool, _ = make_pool()
    make_deployment(pool)
    make_deployment(pool, model="qwen2.5-7b")
    with pytest.raises(ValidationError, match="still has 2 deployments"):
        pools.do_delete_pool(pool)
    assert GpuPool.objects.filter(pk=pool.pk).exists()


def test_the_pool_action_validates_like_the_api(gpu_classes: None) -> None:
    l4 = GpuClass.objects.get(name="L4-24GB")
    with pytest.raises(ValidationError) as refused:
        pools.do_create_pool(name="x y", gpu_class=l4, region="r", usd_per_gpu_hour=Decimal(-1))
    assert set(refused.value.message_dict) == {"name", "usd_per_gpu_hour"}
    with pytest.raises(ValidationError, match="cannot be set: created_at"):
        pools.do_create_pool(name="ok", gpu_class=l4, region="r", created_at=None)
    assert not GpuPool.objects.exists()
