from __future__ import annotations

import pytest
from django.test import Client
from pytest_django import Settings


def test_healthz_answers_without_touching_any_service(client: Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.django_db
def test_readyz_is_ok_when_postgres_and_redis_answer(client: Client) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["checks"] == {"postgres": "ok", "redis": "ok"}


@pytest.mark.django_db
def test_readyz_is_503_naming_redis_when_redis_is_unreachable(
    client: Client, settings: Settings
) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["checks"] == {"postgres": "ok", "redis": "fail"}
    assert "redis" in body["errors"]
    assert "postgres" not in body["errors"]


@pytest.mark.django_db
def test_readyz_names_the_failed_service_but_not_its_error(
    client: Client, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    with caplog.at_level("WARNING", logger="config.health"):
        body = client.get("/readyz").json()
    assert body["errors"] == {"redis": "redis is unreachable; the server log has the error"}
    # The driver's message (host, port, errno) reaches the log only.
    assert "127.0.0.1:1" in caplog.text or "Connection" in caplog.text


@pytest.mark.django_db
def test_gateway_readiness_needs_redis_only(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from config import health

    monkeypatch.setattr(health, "check_postgres", lambda: "OperationalError: connection refused")
    assert client.get("/readyz").status_code == 503
    response = client.get("/readyz/gateway")
    assert response.status_code == 200
    assert response.json()["checks"] == {"redis": "ok"}


@pytest.mark.django_db
def test_the_api_docs_page_loads_swagger_ui_from_our_own_static_files(admin_client: Client) -> None:
    page = admin_client.get("/api/v1/docs/").content.decode()
    assert "drf_spectacular_sidecar/swagger-ui-dist" in page
    assert "cdn." not in page and "https://" not in page.split("<body", 1)[0]
