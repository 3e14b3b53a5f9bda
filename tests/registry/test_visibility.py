"""A tenant never sees a model, version, adapter or deployment that is not visible to it:
not in lists, and 404 (never 403) on the row itself."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

from registry.actions import (
    do_create_adapter,
    do_create_deployment,
    do_create_version,
    is_name_visible_to_tenant,
    publish_visibility,
    published_name_visible,
    visible_models_for_tenant,
)
from registry.models import Adapter, Deployment, Model, Visibility
from serving.models import GpuPool
from serving.redis_contracts import VISIBILITY_HASH
from tenants.models import Tenant
from tests.registry.conftest import approved_version, client_for


@pytest.fixture
def acme_rows(
    acme: Tenant, acme_only_model: Model, llama_8b: Model, pools: dict[str, GpuPool]
) -> dict[str, Any]:
    qwen = approved_version(acme_only_model, "v1", "fp8")
    llama = approved_version(llama_8b, "v1", "bf16")
    return {
        "model": acme_only_model,
        "version": qwen,
        "deployment": do_create_deployment(
            name="qwen-72b-h200", model_version=qwen, pool=pools["h200"]
        ),
        # Public base model, adapter owned by acme.
        "adapter": do_create_adapter(
            name="acme-tone",
            base_version=llama,
            rank=8,
            artifact_uri="s3://adapters/acme-tone/",
            owner_tenant=acme,
        ),
    }


ROUTES = {
    "model": "models",
    "version": "versions",
    "deployment": "deployments",
    "adapter": "adapters",
}


@pytest.mark.parametrize("kind", list(ROUTES))
def test_another_tenant_gets_404_for_a_row_not_visible_to_it(
    acme_rows: dict[str, Any], globex_user: Any, kind: str
) -> None:
    response = client_for(globex_user).get(f"/api/v1/{ROUTES[kind]}/{acme_rows[kind].pk}/")
    assert response.status_code == 404


@pytest.mark.parametrize("kind", list(ROUTES))
def test_another_tenant_does_not_find_the_row_in_lists(
    acme_rows: dict[str, Any], globex_user: Any, kind: str
) -> None:
    listed = client_for(globex_user).get(f"/api/v1/{ROUTES[kind]}/").json()["results"]
    assert acme_rows[kind].pk not in {row["id"] for row in listed}


@pytest.mark.parametrize("kind", list(ROUTES))
def test_the_granted_tenant_sees_the_row(
    acme_rows: dict[str, Any], acme_user: Any, kind: str
) -> None:
    response = client_for(acme_user).get(f"/api/v1/{ROUTES[kind]}/{acme_rows[kind].pk}/")
    assert response.status_code == 200
    assert "granted_tenants" not in response.json()


def test_a_public_model_is_visible_to_every_tenant(
    llama_8b: Model, acme: Tenant, globex: Tenant
) -> None:
    assert llama_8b in visible_models_for_tenant(acme.pk)
    assert llama_8b in visible_models_for_tenant(globex.pk)


def test_a_public_adapter_on_a_restricted_model_stays_hidden_from_other_tenants(
    acme_rows: dict[str, Any], globex_user: Any
) -> None:
    adapter = do_create_adapter(
        name="qwen-sql",
        base_version=acme_rows["version"],
        artifact_uri="s3://adapters/qwen-sql/",
        visibility=Visibility.PUBLIC,
    )
    response = client_for(globex_user).get(f"/api/v1/adapters/{adapter.pk}/")
    assert response.status_code == 404


def test_a_tenant_member_cannot_approve_a_version(llama_8b: Model, acme_user: Any) -> None:
    version = do_create_version(llama_8b, version="v9", artifact_uri="hf://example/llama")
    response = client_for(acme_user).post(f"/api/v1/versions/{version.pk}/approve/")
    assert response.status_code == 403
    version.refresh_from_db()
    assert version.status == "draft"


def test_staff_approve_a_draft_version_and_are_recorded(llama_8b: Model, staff: Any) -> None:
    version = do_create_version(llama_8b, version="v9", artifact_uri="hf://example/llama")
    response = client_for(staff).post(f"/api/v1/versions/{version.pk}/approve/")
    assert response.status_code == 200
    assert (response.json()["status"], response.json()["approved_by"]) == ("approved", "ops")


def test_a_draft_version_cannot_be_deployed(
    llama_8b: Model, staff: Any, pools: dict[str, GpuPool]
) -> None:
    version = do_create_version(llama_8b, version="v9", artifact_uri="hf://example/llama")
    response = client_for(staff).post(
        "/api/v1/deployments/",
        {"model_version": version.pk, "pool": "l4-us-east"},
        format="json",
    )
    assert response.status_code == 400
    assert not Deployment.objects.exists()


def test_the_published_visibility_hash_matches_the_database(
    acme_rows: dict[str, Any], acme: Tenant, globex: Tenant, redis_client: redis.Redis
) -> None:
    publish_visibility(redis_client)
    entries = {
        (name.decode() if isinstance(name, bytes) else name): json.loads(value)
        for name, value in redis_client.hgetall(VISIBILITY_HASH).items()
    }
    for name in [*Model.objects.values_list("name", flat=True), "acme-tone"]:
        for tenant in (acme, globex):
            assert published_name_visible(entries, name, tenant.pk) == is_name_visible_to_tenant(
                name, tenant.pk
            ), (name, tenant.slug)
    assert not published_name_visible(entries, "qwen2.5-72b", globex.pk)
    assert published_name_visible(entries, "acme-tone", acme.pk)
    assert Adapter.objects.count() == 1
