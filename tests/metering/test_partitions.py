"""Usage events partitioned by month: made ahead, adopted from the default partition, dropped
past the retention, billed once across all of it, and an existing table converted in place."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import redis
from django.core.management import call_command
from django.db import connection
from django.db.migrations.loader import MigrationLoader

from metering import ingest, partitions
from metering.models import UsageEvent
from metering.partitions import Month
from metering.usage import add_usage_event
from tenants.models import Tenant
from tests.metering.helpers import event

NOW = datetime(2031, 5, 17, 12, 0, tzinfo=UTC)


@pytest.fixture
def acme(db: None) -> Tenant:
    return Tenant.objects.create(slug="acme", name="Acme")


def table_of(request_id: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tableoid::regclass::text FROM metering_usageevent WHERE request_id = %s",
            [request_id],
        )
        rows = cursor.fetchall()
    assert len(rows) == 1, rows
    return str(rows[0][0])


def at(moment: datetime) -> float:
    return moment.timestamp()


def ingest_events(client: redis.Redis, events: list) -> int:
    pipe = client.pipeline(transaction=False)
    for each in events:
        add_usage_event(pipe, each)
    pipe.execute()
    return ingest.Consumer(client, "partitions", batch_size=50).drain(max_seconds=10).inserted


def test_the_month_and_the_next_two_have_partitions_and_nothing_is_made_twice(acme) -> None:
    created = partitions.ensure_partitions(NOW)
    assert created == [
        "metering_usageevent_p203105",
        "metering_usageevent_p203106",
        "metering_usageevent_p203107",
    ]
    assert partitions.ensure_partitions(NOW) == []
    assert {Month(2031, 5), Month(2031, 6), Month(2031, 7)} <= set(partitions.partitions())
    # December rolls over into the next year.
    assert Month(2031, 12).plus(1) == Month(2032, 1) and Month(2032, 1).plus(-1).month == 12


def test_an_event_lands_in_its_months_partition_and_a_replay_is_billed_once(
    acme, redis_client: redis.Redis
) -> None:
    partitions.ensure_partitions(NOW)
    may = event(acme.pk, started_at=at(NOW), ended_at=at(NOW) + 1)
    june = event(acme.pk, started_at=at(datetime(2031, 6, 2, tzinfo=UTC)))
    assert ingest_events(redis_client, [may, june]) == 2
    assert table_of(may.request_id) == "metering_usageevent_p203105"
    assert table_of(june.request_id) == "metering_usageevent_p203106"
    # The same events again (a spool replayed, a reclaim after a lost ack): nothing added.
    assert ingest_events(redis_client, [may, june]) == 0
    assert UsageEvent.objects.filter(request_id__in=[may.request_id, june.request_id]).count() == 2


def test_rows_of_a_month_without_partition_are_moved_out_of_the_default_one(
    acme, redis_client: redis.Redis
) -> None:
    partitions.ensure_partitions(NOW)
    # The maintenance task was down: an event of a month with no partition yet.
    late = event(acme.pk, started_at=at(datetime(2031, 11, 3, tzinfo=UTC)))
    assert ingest_events(redis_client, [late]) == 1
    assert table_of(late.request_id) == "metering_usageevent_default"

    created = partitions.ensure_partitions(NOW)
    assert created == ["metering_usageevent_p203111"]
    assert table_of(late.request_id) == "metering_usageevent_p203111"
    # Still billed once: a replay now meets it in its new partition.
    assert ingest_events(redis_client, [late]) == 0


def test_partitions_past_the_retention_are_dropped_and_the_rest_kept(
    acme, redis_client: redis.Redis
) -> None:
    for month in (Month(2030, 3), Month(2030, 4), Month(2030, 5)):
        partitions.create_partition(month)
    partitions.ensure_partitions(NOW)
    old = event(acme.pk, started_at=at(datetime(2030, 4, 9, tzinfo=UTC)))
    kept = event(acme.pk, started_at=at(datetime(2030, 5, 9, tzinfo=UTC)))
    assert ingest_events(redis_client, [old, kept]) == 2

    assert partitions.drop_expired(NOW, retention_months=0) == []
    # 12 months before May 2031 is May 2030: March and April 2030 go, May 2030 stays.
    dropped = partitions.drop_expired(NOW, retention_months=12)
    assert {"metering_usageevent_p203003", "metering_usageevent_p203004"} <= set(dropped)
    assert all(Month(int(t[-6:-2]), int(t[-2:])) < Month(2030, 5) for t in dropped)
    assert not UsageEvent.objects.filter(request_id=old.request_id).exists()
    assert table_of(kept.request_id) == "metering_usageevent_p203005"


@pytest.mark.django_db(transaction=True)
def test_the_migration_converts_a_table_with_rows_and_back() -> None:
    tenant = Tenant.objects.create(slug="migrated", name="Migrated")
    call_command("migrate", "metering", "0003", verbosity=0)
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT relkind FROM pg_class WHERE relname = 'metering_usageevent'",
            )
            assert cursor.fetchone() == ("r",)  # a plain table again
        before = event(tenant.pk, started_at=at(datetime(2029, 8, 1, 6, tzinfo=UTC)))
        # The model as of 0003: today's has columns that later migrations added.
        model_0003 = (
            MigrationLoader(connection)
            .project_state(("metering", "0003_usage_trace_id"))
            .apps.get_model("metering", "UsageEvent")
        )
        names_0003 = {field.name for field in model_0003._meta.get_fields()}
        row = {
            name: getattr(before, name)
            for name in ingest.COLUMNS
            if name in names_0003 and name not in ("started_at", "ended_at")
        }
        model_0003._default_manager.create(
            **row,
            started_at=datetime(2029, 8, 1, 6, tzinfo=UTC),
            ended_at=datetime(2029, 8, 1, 6, 1, tzinfo=UTC),
        )
    finally:
        call_command("migrate", "metering", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE relname = 'metering_usageevent'")
        assert cursor.fetchone() == ("p",)
    assert table_of(before.request_id) == "metering_usageevent_p202908"
    UsageEvent.objects.filter(tenant_id=tenant.pk).delete()
