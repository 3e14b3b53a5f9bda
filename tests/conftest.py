"""Fixtures shared by the whole suite: real PostgreSQL (pytest-django) and real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.conf import settings

from tests.redis_cluster import LocalRedisCluster


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings: Any) -> None:
    """Tests hash passwords with MD5: the production hasher's cost (about 0.3 s a password on
    these machines) buys nothing in a test and made the login tests the suite's slowest."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    """The Redis named by REDIS_URL, emptied before and after the test."""
    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def redis_cluster(settings: Any) -> Iterator[LocalRedisCluster]:
    """REDIS_CLUSTER on, REDIS_URL naming one node of a fresh local 3-master cluster."""
    with LocalRedisCluster() as cluster:
        settings.REDIS_CLUSTER = True
        settings.REDIS_URL = cluster.url
        yield cluster


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Browser tests run last: Playwright's sync API leaves an event loop marked running on
    the main thread for the rest of the session, which asyncio-based tests cannot share."""
    items.sort(key=lambda item: item.get_closest_marker("browser") is not None)
