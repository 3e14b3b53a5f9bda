"""The registry API on the platform's base: an API key reads what its tenant sees and never
writes (a key is never staff); a version registered over the API is always a draft."""

from __future__ import annotations

from typing import Any

from rest_framework.test import APIClient

from registry.actions import do_create_deployment
from registry.models import Model, ModelVersion
from tenants.actions import do_create_api_key
from tenants.models import Tenant
from tests.registry.conftest import approved_version, client_for


def bearer(tenant: Tenant, creator: Any, *scopes: str) -> APIClient:
    _, raw = do_create_api_key(tenant, "automation", creator, list(scopes))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def test_a_manage_key_lists_the_models_its_tenant_sees(
    acme: Tenant, acme_user: Any, acme_only_model: Model, llama_8b: Model
) -> None:
    response = bearer(acme, acme_user, "manage").get("/api/v1/models/")
    assert response.status_code == 200
    assert [m["name"] for m in response.json()["results"]] == ["llama-3.1-8b", "qwen2.5-72b"]


def test_another_tenants_key_gets_404_for_a_model_granted_to_acme(
    globex: Tenant, globex_user: Any, acme_only_model: Model
) -> None:
    client = bearer(globex, globex_user, "read_usage")
    assert client.get(f"/api/v1/models/{acme_only_model.pk}/").status_code == 404


def test_a_key_made_by_staff_still_cannot_write_to_the_registry(
    acme: Tenant, staff: Any, llama_8b: Model
) -> None:
    client = bearer(acme, staff, "manage")
    response = client.patch(f"/api/v1/models/{llama_8b.pk}/", {"description": "x"}, format="json")
    assert response.status_code == 403
    llama_8b.refresh_from_db()
    assert llama_8b.description == ""


def test_a_version_registered_over_the_api_is_a_draft_whatever_the_body_says(
    staff: Any, llama_8b: Model
) -> None:
    response = client_for(staff).post(
        "/api/v1/versions/",
        {
            "model": llama_8b.pk,
            "version": "v7",
            "artifact_uri": "hf://example/llama-v7",
            "status": "approved",
        },
        format="json",
    )
    assert response.status_code == 201, response.json()
    assert response.json()["status"] == "draft"
    assert ModelVersion.objects.get(pk=response.json()["id"]).status == "draft"


def test_deleting_a_deployed_model_is_a_400_saying_what_to_do_first(
    staff: Any, llama_8b: Model, pools: Any
) -> None:
    version = approved_version(llama_8b, "v1", "bf16")
    do_create_deployment(name="llama-l4", model_version=version, pool=pools["l4"])
    response = client_for(staff).delete(f"/api/v1/models/{llama_8b.pk}/")
    assert response.status_code == 400
    assert response.json() == ["Stop and delete this model's deployments first."]
    assert Model.objects.filter(pk=llama_8b.pk).exists()
