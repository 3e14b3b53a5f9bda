"""Fixtures shared by the whole suite: real PostgreSQL (pytest-django) and real Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from django.conf import settings


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    """The Redis named by REDIS_URL, emptied before and after the test."""
    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Browser tests run last: Playwright's sync API leaves an event loop marked running on
    the main thread for the rest of the session, which asyncio-based tests cannot share."""
    items.sort(key=lambda item: item.get_closest_marker("browser") is not None)
