"""The console's overview and fleet pages still render when Redis or PostgreSQL is away: the
figures that need the missing service give way to a banner that names it, never a 500."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import OperationalError
from django.test import Client
from pytest_django import Settings

from serving.actions.gpu_classes import sync_gpu_classes
from serving.models import GpuClass, GpuPool

REDIS_BANNER = "Live figures unavailable: Redis is unreachable"
POSTGRES_BANNER = "Live figures unavailable: PostgreSQL is not answering"


@pytest.fixture
def staff(db: None) -> Client:
    admin = get_user_model().objects.create_superuser("ops", "ops@example.com", "pw")
    client = Client()
    client.force_login(admin)
    return client


@pytest.fixture
def h100_pool(db: None) -> GpuPool:
    sync_gpu_classes(GpuClass)
    gpu_class = GpuClass.objects.get(name="H100-SXM-80GB")
    return GpuPool.objects.create(name="h100-a", gpu_class=gpu_class, region="us-east")


@pytest.fixture
def redis_away(settings: Settings) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1


@pytest.mark.parametrize("path", ["/console/", "/console/fleet/"])
def test_with_redis_unreachable_the_page_renders_with_the_banner(
    staff: Client, h100_pool: GpuPool, redis_away: None, path: str
) -> None:
    response = staff.get(path)
    assert response.status_code == 200
    page = response.content.decode()
    assert REDIS_BANNER in page


@pytest.mark.parametrize("path", ["/console/", "/console/fleet/"])
def test_with_redis_up_there_is_no_banner(
    staff: Client, h100_pool: GpuPool, redis_client: Any, path: str
) -> None:
    response = staff.get(path)
    assert response.status_code == 200
    assert "Live figures unavailable" not in response.content.decode()


def test_the_overview_keeps_the_database_figures_when_redis_is_away(
    staff: Client, h100_pool: GpuPool, redis_away: None
) -> None:
    response = staff.get("/console/")
    assert response.context["snapshot"]["cost_per_hour"] == 0.0
    assert response.context["snapshot"]["tokens_per_s"] is None
    assert response.context["history"] == {"at": [], "tokens_per_s": [], "queue_depth": []}


def test_when_the_figures_query_times_out_the_overview_says_postgres_is_not_answering(
    staff: Client, redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from serving.console import queries

    def cancelled(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("canceling statement due to statement timeout")

    monkeypatch.setattr(queries, "latency_figures", cancelled)
    response = staff.get("/console/")
    assert response.status_code == 200
    assert POSTGRES_BANNER in response.content.decode()
