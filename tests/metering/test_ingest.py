"""The usage stream drained into PostgreSQL exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.db import connection
from django.db.models import Count, Sum

from metering import ingest
from metering.models import UsageEvent
from metering.usage import USAGE_STREAM, add_usage_event
from metering.usage import UsageEvent as Event
from tenants.models import Tenant
from tests.metering.helpers import event

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def acme(db: None) -> Tenant:
    return Tenant.objects.create(slug="acme", name="Acme")


def write(client: redis.Redis, events: list[Event]) -> None:
    pipe = client.pipeline(transaction=False)
    for e in events:
        add_usage_event(pipe, e)
    pipe.execute()


def totals() -> dict[str, int]:
    return UsageEvent.objects.aggregate(
        n=Count("request_id"), prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens")
    )


def expected(events: list[Event]) -> dict[str, int]:
    return {
        "n": len(events),
        "prompt": sum(e.prompt_tokens for e in events),
        "completion": sum(e.completion_tokens for e in events),
    }


def test_a_drained_stream_lands_in_postgres_and_is_acknowledged(
    acme: Tenant, redis_client: redis.Redis
) -> None:
    events = [event(acme.pk) for _ in range(250)]
    write(redis_client, events)
    result = ingest.Consumer(redis_client, "c1", batch_size=100).drain(max_seconds=10)
    assert (result.inserted, totals()) == (250, expected(events))
    assert redis_client.xpending(USAGE_STREAM, ingest.GROUP)["pending"] == 0


def test_an_event_written_twice_is_stored_once(acme: Tenant, redis_client: redis.Redis) -> None:
    events = [event(acme.pk) for _ in range(20)]
    write(redis_client, events + events[:5])
    ingest.Consumer(redis_client, "c1").drain(max_seconds=10)
    write(redis_client, events[5:10])  # a spool replay after the first drain
    ingest.Consumer(redis_client, "c1").drain(max_seconds=10)
    assert totals() == expected(events)


def test_an_entry_that_does_not_parse_is_set_aside_not_retried(
    acme: Tenant, redis_client: redis.Redis
) -> None:
    redis_client.xadd(USAGE_STREAM, {b"e": b"{not json"})
    write(redis_client, [event(acme.pk)])
    result = ingest.Consumer(redis_client, "c1").drain(max_seconds=10)
    assert (result.inserted, result.dead, redis_client.xlen(ingest.DEAD_STREAM)) == (1, 1, 1)


def test_what_a_dead_consumer_left_pending_is_reclaimed(
    acme: Tenant, redis_client: redis.Redis
) -> None:
    events = [event(acme.pk) for _ in range(30)]
    write(redis_client, events)
    ingest.ensure_group(redis_client)
    redis_client.xreadgroup(ingest.GROUP, "dead", {USAGE_STREAM: ">"}, count=30)
    ingest.Consumer(redis_client, "alive", min_idle_ms=0).drain(max_seconds=10)
    assert totals() == expected(events)
    assert redis_client.xpending(USAGE_STREAM, ingest.GROUP)["pending"] == 0


def _consumer_process(name: str, *extra: str) -> subprocess.Popen[str]:
    db = connection.settings_dict
    url = f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    return subprocess.Popen(
        [sys.executable, "manage.py", "metering_consume", "--name", name, *extra],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": url, "REDIS_URL": settings.REDIS_URL},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _kill_on(process: subprocess.Popen[str], phase: str, nth: int) -> None:
    seen = 0
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(phase):
            seen += 1
            if seen == nth:
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=10)
                return
    raise AssertionError(f"consumer exited before its {nth}th {phase!r}: {process.returncode}")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("phase", ["inserted", "committed"])
def test_a_consumer_killed_mid_batch_loses_nothing_and_counts_nothing_twice(
    redis_client: redis.Redis, phase: str
) -> None:
    """SIGKILL in the middle of the 3rd batch: after its insert but before its commit, or after
    its commit but before its ack. A new consumer reclaims the batch; totals match exactly."""
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    events = [event(tenant.pk) for _ in range(1000)]
    write(redis_client, events)
    victim = _consumer_process("victim", "--batch", "200", "--hold-ms", "400")
    _kill_on(victim, phase, 3)
    assert redis_client.xpending(USAGE_STREAM, ingest.GROUP)["pending"] == 200
    survivor = _consumer_process("survivor", "--until-empty", "--min-idle-ms", "0")
    output, _ = survivor.communicate(timeout=120)
    assert survivor.returncode == 0, output
    assert totals() == expected(events)
    assert redis_client.xpending(USAGE_STREAM, ingest.GROUP)["pending"] == 0
