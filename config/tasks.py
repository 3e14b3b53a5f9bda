"""Platform-wide Celery tasks."""

from __future__ import annotations

from config.celery import task
from config.redis import redis_client


@task(name="platform.ping", ignore_result=True)
def ping(token: str) -> None:
    """Write a token back to Redis: proof that a worker picked up and ran a task."""
    redis_client().set(f"platform:ping:{token}", "pong", ex=60)
