"""Platform-wide Celery tasks."""

from __future__ import annotations

import redis
from celery import shared_task
from django.conf import settings


@shared_task(name="platform.ping", ignore_result=True)
def ping(token: str) -> None:
    """Write a token back to Redis: proof that a worker picked up and ran a task."""
    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)
    client.set(f"platform:ping:{token}", "pong", ex=60)
