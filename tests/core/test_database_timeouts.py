"""A stalled PostgreSQL costs a request seconds: the connection's timeouts are set, and a view
that meets one answers a fast 503 with Retry-After (JSON on /api, a page on the console).

The stalls are real: another connection holds an ACCESS EXCLUSIVE lock on the table the page
reads, or the database address accepts TCP and never answers.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client

# The web processes' default (DATABASE_STATEMENT_TIMEOUT_MS), plus room for the round trips.
STATEMENT_TIMEOUT_S = settings.DATABASE_STATEMENT_TIMEOUT_MS / 1000
PATIENCE_S = STATEMENT_TIMEOUT_S + 3


@pytest.fixture
def staff_client(transactional_db: None) -> Client:
    # transactional_db: no test-wide transaction, so a cancelled statement leaves the
    # connection usable for the "after the release" request.
    admin = get_user_model().objects.create_superuser("ops", "ops@example.com", "pw")
    client = Client()
    client.force_login(admin)
    return client


@contextmanager
def table_locked(table: str) -> Iterator[None]:
    """Another session holds `table` in ACCESS EXCLUSIVE mode until the block ends."""
    params: dict[str, Any] = dict(connection.get_connection_params())
    params.pop("cursor_factory", None)
    params.pop("context", None)
    params["options"] = "-c statement_timeout=0"
    with psycopg.connect(**params) as locker:
        locker.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        try:
            yield
        finally:
            locker.rollback()


def timed_get(client: Client, path: str) -> tuple[Any, float]:
    started = time.monotonic()
    response = client.get(path)
    return response, time.monotonic() - started


def test_every_connection_carries_the_connect_statement_and_idle_timeouts(
    transactional_db: None,
) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SHOW statement_timeout")
        assert cursor.fetchone()[0] == "5s"
        cursor.execute("SHOW idle_in_transaction_session_timeout")
        assert cursor.fetchone()[0] == "1min"
    assert connection.get_connection_params()["connect_timeout"] == 3


def test_the_api_answers_503_json_while_the_table_is_locked_then_200_after(
    staff_client: Client,
) -> None:
    with table_locked("tenants_tenant"):
        response, elapsed = timed_get(staff_client, "/api/v1/tenants/")
    assert response.status_code == 503
    assert elapsed < PATIENCE_S
    assert response["Retry-After"] == "5"
    assert response.json() == {"detail": "The database is not answering; retry shortly."}
    assert staff_client.get("/api/v1/tenants/").status_code == 200


def test_a_console_page_answers_a_503_page_while_its_table_is_locked(
    staff_client: Client,
) -> None:
    with table_locked("serving_gpupool"):
        response, elapsed = timed_get(staff_client, "/console/fleet/")
    assert response.status_code == 503
    assert elapsed < PATIENCE_S
    assert response["Retry-After"] == "5"
    assert "The database is not answering" in response.content.decode()
    assert staff_client.get("/console/fleet/").status_code == 200


def test_a_statement_that_runs_past_the_timeout_is_cancelled_into_a_503(
    staff_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tenants.api import views

    def slow_queryset(self: Any) -> Any:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(30)")
        raise AssertionError("the statement timeout did not cancel pg_sleep")

    monkeypatch.setattr(views.TenantViewSet, "get_queryset", slow_queryset)
    response, elapsed = timed_get(staff_client, "/api/v1/tenants/")
    assert response.status_code == 503
    assert STATEMENT_TIMEOUT_S - 0.5 < elapsed < PATIENCE_S


@pytest.fixture
def silent_database() -> Iterator[int]:
    """A port that accepts TCP connections (the kernel's backlog) and never says a word, as a
    frozen PostgreSQL does."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield int(listener.getsockname()[1])


def test_a_database_that_never_answers_the_handshake_is_a_503_within_the_connect_timeout(
    staff_client: Client, silent_database: int
) -> None:
    connection.close()
    real_host, real_port = connection.settings_dict["HOST"], connection.settings_dict["PORT"]
    connection.settings_dict.update(HOST="127.0.0.1", PORT=str(silent_database))
    try:
        response, elapsed = timed_get(staff_client, "/api/v1/tenants/")
    finally:
        connection.close()
        connection.settings_dict.update(HOST=real_host, PORT=real_port)
    assert response.status_code == 503
    assert elapsed < settings.DATABASE_CONNECT_TIMEOUT_S + 2
    assert response.json()["detail"].startswith("The database is not answering")
