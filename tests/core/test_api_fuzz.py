"""Schemathesis over /api/v1/'s own OpenAPI schema, in process: every operation, as staff and
as a tenant admin, answers no 5xx and every error in DRF's JSON format.

The schema is drf-spectacular's, generated from the URLconf (what /api/v1/schema/ serves).
Requests go through Django's WSGI handler with a real session cookie and CSRF token, so the
middleware, DRF's CSRF check and the exception handler all run as in production. A small
world (tenants, a pool, a model with a deployment, keys, a node, a price sheet, an invoice)
lets the path parameters name real rows about half the time; each example runs in a
savepoint rolled back after it, so examples do not see each other's writes.

Deterministic (hypothesis derandomized, no example database) and bounded: 15 examples per
operation (the examples and fuzzing phases, positive and negative), 100 operations as staff
and the 42 a member reaches as the admin: about 100 s on two cores. Marked slow, so
`-m "not slow"` leaves it out; `make test` runs it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import hypothesis
import pytest
import schemathesis
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import got_request_exception, request_finished, request_started
from django.db import close_old_connections, transaction
from django.middleware.csrf import _get_new_csrf_string
from django.test import Client
from drf_spectacular.generators import SchemaGenerator
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from tests.core.api_world import build_world, path_values

# django_db: each test, in its own savepoint, inside the module's world.
pytestmark = [pytest.mark.slow, pytest.mark.django_db]

EXAMPLES_PER_OPERATION = 15

schema = schemathesis.openapi.from_dict(SchemaGenerator().get_schema(request=None, public=True))
# The examples and fuzzing phases, bounded by max_examples. The coverage phase generates every
# boundary case the schema defines whatever max_examples says: over five minutes here.
schema.config.phases.coverage.enabled = False

# Filled by the `world` fixture before any case is drawn: the real value of each path
# parameter, by route, for the deferred strategy below.
KNOWN: dict[str, dict[str, Any]] = {}


@schema.hook
def before_generate_path_parameters(context: Any, strategy: Any) -> Any:
    """Half the time the generated values (mostly 404s), half the time a real row's."""
    path = context.operation.path
    if "{" not in path:
        return strategy
    real = st.deferred(lambda: st.just(KNOWN[path]) if KNOWN.get(path) else strategy)
    return st.one_of(strategy, real)


class Caught:
    """The exception behind a 500, so a failure shows its traceback, not only its status."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def __call__(self, sender: Any, request: Any = None, **kwargs: Any) -> None:
        self.errors.append(sys.exc_info()[1] or RuntimeError("unknown"))


@pytest.fixture
def wsgi_app() -> Iterator[WSGIHandler]:
    # Django's own test client does this too: a request must not close the test's
    # connection (and its transaction) when it finishes.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield WSGIHandler()
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture(scope="module")
def world(django_db_setup: None, django_db_blocker: Any) -> Iterator[dict[str, Any]]:
    """Built once for the module in a transaction rolled back after it (one world for its
    ~150 tests; building it costs a second or two)."""
    with django_db_blocker.unblock(), transaction.atomic():
        built = build_world()
        for result in schema.get_all_operations():
            path = result.ok().path  # type: ignore[union-attr]  # an Err fails the load
            KNOWN[path] = path_values(path, built)
        yield {"staff": session_for(built.staff), "member": session_for(built.admin)}
        transaction.set_rollback(True)
    KNOWN.clear()


def session_for(user: Any) -> tuple[dict[str, str], dict[str, str]]:
    """The cookies and headers of a signed-in browser: a session and its CSRF token."""
    client = Client()
    client.force_login(user)
    csrf = _get_new_csrf_string()
    cookies = {"sessionid": client.cookies["sessionid"].value, "csrftoken": csrf}
    return cookies, {"X-CSRFToken": csrf}


def errors_are_drf_json(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx and 5xx under /api is JSON: `{"detail": ...}`, `{field: [...]}` or `[...]`."""
    if response.status_code < 400:
        return None
    content_type = response.headers.get("content-type", [""])[0]
    assert content_type.startswith("application/json"), (
        f"{response.status_code} answered as {content_type!r}: {response.text[:200]!r}"
    )
    assert isinstance(response.json(), dict | list)
    return None


def run_case(case: Any, app: WSGIHandler, session: tuple[dict[str, str], dict[str, str]]) -> None:
    cookies, headers = session
    caught = Caught()
    got_request_exception.connect(caught)
    try:
        with transaction.atomic():
            response = case.call(app=app, cookies=cookies, headers=headers)
            transaction.set_rollback(True)
    finally:
        got_request_exception.disconnect(caught)
    if caught.errors:
        error = caught.errors[0]
        raise AssertionError(
            f"{case.method} {case.formatted_path}: 500 from {type(error).__name__}: {error}"
        ) from error
    case.validate_response(response, checks=[not_a_server_error, errors_are_drf_json])


FUZZ_SETTINGS = hypothesis.settings(
    max_examples=EXAMPLES_PER_OPERATION,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)


@schema.parametrize()
@FUZZ_SETTINGS
def test_no_operation_answers_a_server_error_to_staff(
    case: Any, wsgi_app: WSGIHandler, world: dict[str, Any]
) -> None:
    run_case(case, wsgi_app, world["staff"])


def what_a_member_reaches(context: Any) -> bool:
    """The tenant's own routes, by every method, and the registry's and price sheets' reads;
    the staff routes answer a member 403 before they read any input."""
    operation = context.operation
    return operation.path.startswith("/api/v1/tenants/") or (
        operation.method.upper() == "GET"
        and operation.path.split("/")[3]
        in {"models", "versions", "adapters", "deployments", "price-sheets"}
    )


@schema.include(what_a_member_reaches).parametrize()
@FUZZ_SETTINGS
def test_no_operation_answers_a_server_error_to_a_tenant_admin(
    case: Any, wsgi_app: WSGIHandler, world: dict[str, Any]
) -> None:
    run_case(case, wsgi_app, world["member"])


def signed_in(session: tuple[dict[str, str], dict[str, str]]) -> Client:
    client = Client()
    cookies, _ = session
    client.cookies["sessionid"] = cookies["sessionid"]
    return client


@pytest.mark.parametrize("who", ["staff", "member"])
def test_every_route_answers_options_in_json(world: dict[str, Any], who: str) -> None:
    """OPTIONS is in no schema, so the fuzzer never sends it: every route, once each."""
    client = signed_in(world[who])
    for path in sorted(KNOWN):
        url = path.format(**KNOWN[path]) if KNOWN[path] or "{" not in path else None
        if url is None:
            continue
        response = client.options(url)
        assert response.status_code < 500, (url, response.status_code)
        assert response["Content-Type"].startswith("application/json"), url


def test_the_fuzzers_sessions_get_past_authentication_and_csrf(
    world: dict[str, Any], wsgi_app: WSGIHandler
) -> None:
    """A refused session or CSRF token would make every case a 403 and the fuzzer vacuous."""
    operation = schema.find_operation_by_label("POST /api/v1/pools/")
    assert operation is not None
    case = operation.Case(body={}, media_type="application/json")
    response = case.call(app=wsgi_app, cookies=world["staff"][0], headers=world["staff"][1])
    assert response.status_code == 400, response.text
    assert "name" in response.json()
