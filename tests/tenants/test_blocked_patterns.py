"""Blocked patterns: the API accepts only what the gateway's RE2 can run, and the gateway runs
them in time linear in the prompt."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from serving.gateway.guardrails import (
    MAX_PATTERN_PROGRAM_SIZE,
    GuardrailInput,
    blocked_patterns,
)
from tenants.models import Tenant
from tests.tenants.conftest import user

REFUSAL = "The prompt contains content your organisation has blocked for this API."


@pytest.fixture
def staff(acme: Tenant, django_capture_on_commit_callbacks: Callable[..., Any]) -> Any:
    client = APIClient()
    operator = user("acme-owner")
    operator.is_staff = True
    operator.save()
    client.force_login(operator)
    with django_capture_on_commit_callbacks(execute=True):
        yield client


def set_patterns(client: APIClient, patterns: list[str]) -> Any:
    return client.patch("/api/v1/tenants/acme/", {"blocked_patterns": patterns}, format="json")


def guard(patterns: list[str], *texts: str) -> str | None:
    return blocked_patterns(
        GuardrailInput(
            tenant_slug="acme",
            model="m",
            prompt_texts=texts,
            prompt_tokens=1,
            max_prompt_tokens=None,
            blocked_patterns=tuple(patterns),
        )
    )


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [(r"(secret)\s+\1", "invalid escape sequence"), (r"secret(?!ary)", "invalid perl operator")],
)
def test_the_api_refuses_a_pattern_re2_cannot_run(
    staff: APIClient, pattern: str, reason: str
) -> None:
    response = set_patterns(staff, ["project falcon", pattern])
    assert response.status_code == 400
    [message] = response.json()["blocked_patterns"]
    assert pattern in message and reason in message and "RE2" in message
    assert Tenant.objects.get(slug="acme").blocked_patterns == []


def test_the_api_refuses_patterns_too_large_together(staff: APIClient) -> None:
    response = set_patterns(staff, [rf"[a-z]{{1,200}}x{i}" for i in range(5)])
    assert response.status_code == 400
    [message] = response.json()["blocked_patterns"]
    assert f"over the limit of {MAX_PATTERN_PROGRAM_SIZE}" in message


def test_the_api_saves_patterns_re2_can_run(staff: APIClient) -> None:
    patterns = [r"project\s+falcon", r"\b\d{3}-\d{2}-\d{4}\b", "(a+)+$"]
    response = set_patterns(staff, patterns)
    assert response.status_code == 200, response.content
    assert Tenant.objects.get(slug="acme").blocked_patterns == patterns


def test_a_tenant_created_with_patterns_and_a_status_keeps_them(staff: APIClient) -> None:
    """A create took only slug, name, regions and fail_open, and dropped the rest in silence."""
    body = {"slug": "initech", "name": "Initech", "status": "suspended"}
    response = staff.post(
        "/api/v1/tenants/", {**body, "blocked_patterns": [r"project\s+falcon"]}, format="json"
    )
    assert response.status_code == 201, response.content
    assert response.json()["blocked_patterns"] == [r"project\s+falcon"]
    created = Tenant.objects.get(slug="initech")
    assert (created.blocked_patterns, created.status) == ([r"project\s+falcon"], "suspended")

    refused = staff.post(
        "/api/v1/tenants/", {**body, "slug": "hooli", "blocked_patterns": ["a(?!b)"]}, format="json"
    )
    assert refused.status_code == 400
    assert "RE2" in refused.json()["blocked_patterns"][0]
    assert not Tenant.objects.filter(slug="hooli").exists()


def test_a_catastrophic_backtracking_pattern_runs_in_linear_time() -> None:
    prompt = "a" * 50_000 + "!"
    started = time.perf_counter()
    assert guard(["(a+)+$"], prompt) is None
    assert guard(["(a+)+$"], "a" * 50_000) == REFUSAL
    elapsed = time.perf_counter() - started
    print(f"(a+)+$ over {len(prompt)} characters, twice: {elapsed * 1000:.1f} ms")
    assert elapsed < 2.0


def test_patterns_match_whatever_the_case() -> None:
    assert guard([r"project\s+falcon"], "hello", "Tell me about PROJECT  Falcon") == REFUSAL
    assert guard([r"project\s+falcon"], "project hawk") is None


def test_a_stored_pattern_re2_cannot_run_is_skipped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stored = [r"(codename)\s+\1", "project falcon"]  # valid for Python's re, saved before RE2
    re.compile(stored[0])
    with caplog.at_level(logging.WARNING, logger="serving.gateway.guardrails"):
        assert guard(stored, "codename codename") is None
        assert guard(stored, "Project Falcon") == REFUSAL
    assert "(codename)" in caplog.text and "invalid escape sequence" in caplog.text
