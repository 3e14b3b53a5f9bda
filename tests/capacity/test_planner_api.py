"""The planner's REST endpoint and console page."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

pytestmark = pytest.mark.django_db

TEXTBOOK = {
    "users": 10_000,
    "requests_per_user_s": 0.1,
    "prompt_tokens": 1000,
    "output_tokens": 500,
    "tokens_per_s_per_gpu": 4500,
}


@pytest.fixture(autouse=True)
def _planner_routes(settings: Any) -> None:
    settings.ROOT_URLCONF = "tests.capacity.urls"


@pytest.fixture
def staff_client() -> Client:
    user = get_user_model().objects.create_user("ops", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    return client


def test_the_endpoint_answers_the_textbook_example(staff_client: Client) -> None:
    response = staff_client.post(
        "/test-api/capacity-plan/", TEXTBOOK, content_type="application/json"
    )
    assert response.status_code == 200
    textbook = response.json()["textbook"]
    assert (textbook["gpus"], textbook["gpus_with_headroom"]) == (111, 183)


def test_the_endpoint_plans_the_given_pools(staff_client: Client) -> None:
    body = {
        **TEXTBOOK,
        "pools": [{"name": "h100", "gpu_class": "H100-SXM-80GB", "available_gpus": 10}],
    }
    plan = staff_client.post(
        "/test-api/capacity-plan/", body, content_type="application/json"
    ).json()
    assert plan["pools"][0]["gpus"] == 10
    assert plan["meets_demand"] is False


def test_the_endpoint_rejects_an_unknown_gpu_class(staff_client: Client) -> None:
    body = {**TEXTBOOK, "pools": [{"name": "x", "gpu_class": "TPU-v5"}]}
    response = staff_client.post("/test-api/capacity-plan/", body, content_type="application/json")
    assert response.status_code == 400
    assert "pools" in response.json()


def test_a_tenant_user_may_not_plan_the_fleet() -> None:
    client = Client()
    client.force_login(get_user_model().objects.create_user("dev", password="pw"))
    response = client.post("/test-api/capacity-plan/", TEXTBOOK, content_type="application/json")
    assert response.status_code == 403


def test_the_console_calculator_page_posts_to_itself(staff_client: Client) -> None:
    page = staff_client.get("/test-console/capacity/")
    assert page.status_code == 200
    assert b'hx-post="/test-console/capacity/"' in page.content


def test_the_console_calculator_answers_htmx_with_the_plan(staff_client: Client) -> None:
    result = staff_client.post("/test-console/capacity/", {k: str(v) for k, v in TEXTBOOK.items()})
    assert result.status_code == 200
    assert b"<strong>183</strong>" in result.content
