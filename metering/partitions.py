"""Usage events partitioned by month, and their retention.

`metering_usageevent` is a PostgreSQL table partitioned by range of `started_at`, one partition
per calendar month (UTC) named `metering_usageevent_pYYYYMM`, plus a default partition that
catches an event whose month has no partition yet (so ingest never fails for want of one).
Its primary key is `(request_id, started_at)`: PostgreSQL requires the partition key in every
unique constraint. Exactly-once billing still holds, since a replayed event is the same JSON
with the same `started_at`, so it lands in the same partition and its conflict is found there.

`ensure_partitions` creates this month's and the next `ahead` months' partitions (the batch
worker runs it daily; the migration runs it once). A month whose rows already sit in the default
partition (the task was down for months) is moved out of it in the same transaction, since
PostgreSQL refuses to attach a partition whose rows the default still holds.

`drop_expired` drops whole partitions that ended more than `USAGE_RETENTION_MONTHS` months
before the current one (0 keeps everything): a `DROP TABLE`, not a `DELETE`, so retention
costs no vacuum. Invoices and rollups live in their own tables and outlive the raw events.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from django.db import connection, transaction

logger = logging.getLogger(__name__)

PARENT = "metering_usageevent"
DEFAULT_PARTITION = f"{PARENT}_default"
_NAME = re.compile(rf"^{PARENT}_p(\d{{4}})(\d{{2}})$")


@dataclass(frozen=True, order=True)
class Month:
    year: int
    month: int

    @classmethod
    def of(cls, moment: datetime) -> Month:
        moment = moment.astimezone(UTC)
        return cls(moment.year, moment.month)

    def plus(self, months: int) -> Month:
        index = self.year * 12 + (self.month - 1) + months
        return Month(index // 12, index % 12 + 1)

    @property
    def start(self) -> datetime:
        return datetime(self.year, self.month, 1, tzinfo=UTC)

    @property
    def table(self) -> str:
        return f"{PARENT}_p{self.year:04d}{self.month:02d}"


def partitions() -> list[Month]:
    """The monthly partitions that exist, oldest first (the default partition not included)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = %s::regclass",
            [PARENT],
        )
        names = [row[0] for row in cursor.fetchall()]
    months = []
    for name in names:
        if match := _NAME.match(name):
            months.append(Month(int(match[1]), int(match[2])))
    return sorted(months)


def ensure_partitions(now: datetime, *, ahead: int = 2) -> list[str]:
    """Create the partitions of `now`'s month and the `ahead` months after it, and of every
    month with rows in the default partition; returns the tables created."""
    existing = set(partitions())
    first = Month.of(now)
    wanted = {first.plus(offset) for offset in range(ahead + 1)} | set(_months_in_default())
    created = []
    for month in sorted(wanted - existing):
        create_partition(month)
        created.append(month.table)
    return created


def _months_in_default() -> list[Month]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT date_part('year', started_at AT TIME ZONE 'UTC')::int, "  # nosec B608
            f"date_part('month', started_at AT TIME ZONE 'UTC')::int FROM {DEFAULT_PARTITION}"
        )
        return [Month(year, month) for year, month in cursor.fetchall()]


def create_partition(month: Month) -> None:
    """One month's partition, with any rows of that month moved out of the default partition."""
    start, end = month.start, month.plus(1).start
    table = month.table  # from integers, never from input
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE {table} (LIKE {PARENT} INCLUDING DEFAULTS)")
        cursor.execute(
            f"WITH moved AS (DELETE FROM {DEFAULT_PARTITION} "  # nosec B608
            "WHERE started_at >= %s AND started_at < %s RETURNING *) "
            f"INSERT INTO {table} SELECT * FROM moved",
            [start, end],
        )
        if cursor.rowcount:
            logger.warning("moved %d usage events out of the default partition", cursor.rowcount)
        cursor.execute(
            f"ALTER TABLE {PARENT} ATTACH PARTITION {table} FOR VALUES FROM (%s) TO (%s)",
            [start, end],
        )
    logger.info("created usage event partition %s", table)


def drop_expired(now: datetime, *, retention_months: int) -> list[str]:
    """Drop the partitions that ended before the retention window; returns the tables
    dropped. `retention_months` counts whole months before the current one (0: keep all)."""
    if retention_months <= 0:
        return []
    oldest_kept = Month.of(now).plus(-retention_months)
    dropped = []
    for month in partitions():
        if month < oldest_kept:
            with connection.cursor() as cursor:
                cursor.execute(f"DROP TABLE {month.table}")
            dropped.append(month.table)
            logger.info("dropped usage event partition %s (retention)", month.table)
    return dropped
