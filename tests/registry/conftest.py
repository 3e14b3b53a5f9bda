"""Named tenants (acme, globex), their members, staff, GPU pools and the catalogue models."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from registry.actions import do_create_model, do_create_version
from registry.demo import model_fields
from registry.models import Model, ModelVersion, Visibility
from serving.engine.specs import load_model_specs
from serving.models import GpuClass, GpuPool
from tenants.models import Membership, Role, Tenant


@pytest.fixture
def acme(db: Any) -> Tenant:
    return Tenant.objects.create(slug="acme", name="Acme")


@pytest.fixture
def globex(db: Any) -> Tenant:
    return Tenant.objects.create(slug="globex", name="Globex")


@pytest.fixture
def staff(db: Any) -> Any:
    return get_user_model().objects.create_user("ops", is_staff=True)


def _member(tenant: Tenant, username: str) -> Any:
    user = get_user_model().objects.create_user(username)
    Membership.objects.create(user=user, tenant=tenant, role=Role.ADMIN)
    return user


@pytest.fixture
def acme_user(acme: Tenant) -> Any:
    return _member(acme, "acme-admin")


@pytest.fixture
def globex_user(globex: Tenant) -> Any:
    return _member(globex, "globex-admin")


def client_for(user: Any) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def pools(db: Any) -> dict[str, GpuPool]:
    names = {"l4": "L4-24GB", "h100": "H100-SXM-80GB", "h200": "H200-SXM-141GB"}
    return {
        short: GpuPool.objects.create(
            name=f"{short}-us-east", gpu_class=GpuClass.objects.get(name=gpu), region="us-east"
        )
        for short, gpu in names.items()
    }


def make_model(name: str, **extra: Any) -> Model:
    return do_create_model(name=name, **model_fields(load_model_specs()[name]), **extra)


def approved_version(model: Model, version: str, quantization: str) -> ModelVersion:
    row = do_create_version(
        model,
        version=version,
        artifact_uri=f"hf://example/{model.name}-{version}",
        quantization=quantization,
    )
    row.status = ModelVersion.Status.APPROVED
    row.save()
    return row


@pytest.fixture
def llama_8b(db: Any) -> Model:
    return make_model("llama-3.1-8b")


@pytest.fixture
def llama_70b(db: Any) -> Model:
    return make_model("llama-3.1-70b")


@pytest.fixture
def acme_only_model(acme: Tenant) -> Model:
    return make_model("qwen2.5-72b", visibility=Visibility.RESTRICTED, granted_tenant_ids=[acme.pk])
