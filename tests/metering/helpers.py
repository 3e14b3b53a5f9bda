"""Small builders shared by the metering tests."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import redis

from metering.usage import EVENT_FIELD, USAGE_STREAM, UsageEvent

if TYPE_CHECKING:  # Django-free at import: the spool tests' subprocesses build events here
    from metering import models
    from tenants.models import Tenant

_ids = itertools.count()


def event(tenant_id: int, **fields: object) -> UsageEvent:
    n = next(_ids)
    base: dict[str, object] = {
        "request_id": f"req-{n:09d}",
        "tenant_id": tenant_id,
        "key_id": 1,
        "model": "llama-3.1-8b",
        "version_id": None,
        "adapter": "",
        "deployment_id": None,
        "pool": "h100-east",
        "replica_id": "r1",
        "priority": "standard",
        "prompt_tokens": 100 + n % 50,
        "cached_prompt_tokens": 0,
        "completion_tokens": 20 + n % 30,
        "status": "ok",
        "finish_reason": "stop",
        "queue_ms": 1.0,
        "ttft_ms": 80.0,
        "total_ms": 900.0,
        "started_at": 1_767_225_600.0 + n,  # 2026-01-01
        "ended_at": 1_767_225_601.0 + n,
    }
    base.update(fields)
    return UsageEvent(**base)  # type: ignore[arg-type]


def stream_events(client: redis.Redis) -> list[UsageEvent]:
    """Every event on the usage stream, oldest first."""
    events = []
    for _, fields in client.xrange(USAGE_STREAM) or []:
        assert fields is not None, "an entry without fields"
        events.append(UsageEvent.from_json(fields[EVENT_FIELD]))
    return events


def stored(tenant: Tenant, at: datetime, **fields: Any) -> models.UsageEvent:
    """An event of `tenant` started at `at` and ended a second later (or at `ended_at`, a
    timestamp), in PostgreSQL."""
    from metering import ingest, models

    times = {"started_at": at.timestamp(), "ended_at": at.timestamp() + 1, **fields}
    e = event(tenant.pk, **times)
    row = {name: getattr(e, name) for name in ingest.COLUMNS}
    row["started_at"] = datetime.fromtimestamp(e.started_at, UTC)
    row["ended_at"] = datetime.fromtimestamp(e.ended_at, UTC)
    return models.UsageEvent.objects.create(**row)
