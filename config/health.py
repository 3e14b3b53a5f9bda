"""Liveness and readiness probes.

/healthz says the process answers. /readyz says whether the services the control plane needs
(PostgreSQL and Redis) are reachable, and which one is not.
"""

from __future__ import annotations

import logging

import redis
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from config.redis import redis_client

log = logging.getLogger(__name__)


@require_GET
@never_cache
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def check_postgres() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:  # any failure means "not ready"; the message says why
        connection.close_if_unusable_or_obsolete()
        return f"{type(exc).__name__}: {exc}".strip()
    return None


def check_redis() -> str | None:
    try:
        redis_client().ping()
    except redis.RedisError as exc:
        return f"{type(exc).__name__}: {exc}".strip()
    return None


@require_GET
@never_cache
def readyz(request: HttpRequest) -> JsonResponse:
    return readiness({"postgres": check_postgres(), "redis": check_redis()})


@require_GET
@never_cache
def readyz_gateway(request: HttpRequest) -> JsonResponse:
    """Readiness of a gateway process: the data plane needs Redis only. With PostgreSQL down,
    admitted keys keep streaming, so a load balancer must not take every gateway out."""
    return readiness({"redis": check_redis()})


def readiness(failures: dict[str, str | None]) -> JsonResponse:
    """The answer names which service failed, never its error: driver messages carry hosts,
    ports, user names and versions. The error itself goes to the server log."""
    checks = {name: ("ok" if error is None else "fail") for name, error in failures.items()}
    errors = {}
    for name, error in failures.items():
        if error is not None:
            log.warning("readiness: %s unreachable: %s", name, error)
            errors[name] = f"{name} is unreachable; the server log has the error"
    body: dict[str, object] = {"status": "ok" if not errors else "fail", "checks": checks}
    if errors:
        body["errors"] = errors
    return JsonResponse(body, status=200 if not errors else 503)
