"""The Django admin shows every row but writes only through the actions: the registry's,
the fleet's, usage, invoices and price sheets are read-only there (config/admin.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db import models
from django.test import Client

from config.admin import ReadOnlyAdmin
from config.jobs import Enqueue
from metering.models import (
    BudgetWebhook,
    CostCenter,
    HourlyRollup,
    Invoice,
    PriceSheet,
    TenantDiscount,
    UsageEvent,
)
from registry.models import Adapter, Deployment, Model, ModelVersion, Rollout
from serving.models import Gpu, GpuClass, GpuPool, JoinToken, Node, Replica, TelemetrySample
from tests.core.api_world import build_world

pytestmark = pytest.mark.django_db

READ_ONLY: list[type[models.Model]] = [
    Model,
    ModelVersion,
    Adapter,
    Deployment,
    Rollout,
    GpuClass,
    GpuPool,
    JoinToken,
    Node,
    Replica,
    TelemetrySample,
    PriceSheet,
    UsageEvent,
    Invoice,
    HourlyRollup,
]


@pytest.fixture
def root() -> Client:
    client = Client()
    client.force_login(
        get_user_model().objects.create_user("root", is_staff=True, is_superuser=True)
    )
    return client


def url(model: type[models.Model], page: str) -> str:
    return f"/admin/{model._meta.app_label}/{model._meta.model_name}/{page}"


@pytest.mark.parametrize("model", READ_ONLY, ids=lambda m: m.__name__)
def test_a_row_written_through_the_actions_is_shown_and_never_written_in_the_admin(
    root: Client, model: type[models.Model]
) -> None:
    build_world()
    assert isinstance(admin.site._registry[model], ReadOnlyAdmin)
    assert root.get(url(model, "")).status_code == 200
    assert root.get(url(model, "add/")).status_code == 403
    rows = model._default_manager
    row = rows.order_by("pk").first()
    if row is None:
        return  # the world has none of these (rollouts, samples, rollups): the pages above
    before = rows.values().get(pk=row.pk)
    assert root.get(url(model, f"{row.pk}/change/")).status_code == 200  # a view
    assert root.post(url(model, f"{row.pk}/change/"), {}).status_code == 403
    assert root.post(url(model, f"{row.pk}/delete/"), {"post": "yes"}).status_code == 403
    assert rows.values().get(pk=row.pk) == before


def test_a_deployment_edit_the_admin_once_took_is_refused(root: Client) -> None:
    """Before: a deployment's pool or replica count changed here, with no placement check and
    no reconcile; a finalized invoice's total could be edited."""
    build_world()
    deployment = Deployment.objects.get()
    reply = root.post(url(Deployment, f"{deployment.pk}/change/"), {"replicas_desired": 40})
    assert reply.status_code == 403
    assert Deployment.objects.get().replicas_desired == deployment.replicas_desired
    assert Gpu.objects.exists()  # the inline rows stay too


def test_the_rows_only_the_admin_writes_are_writable_and_a_discount_republishes_prices(
    root: Client, django_capture_on_commit_callbacks: Callable[..., Any]
) -> None:
    world = build_world()
    for model in (TenantDiscount, CostCenter, BudgetWebhook):
        assert not isinstance(admin.site._registry[model], ReadOnlyAdmin)
        assert root.get(url(model, "add/")).status_code == 200
    with django_capture_on_commit_callbacks() as callbacks:
        reply = root.post(
            url(TenantDiscount, "add/"),
            {
                "tenant": world.acme.pk,
                "percent": "12.50",
                "effective_from_0": "2026-01-01",
                "effective_from_1": "00:00:00",
            },
        )
    assert reply.status_code == 302, reply.content
    assert TenantDiscount.objects.get().percent == 12.5
    assert callbacks == [Enqueue("metering.publish_prices")]
