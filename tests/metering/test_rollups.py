"""Hourly rollups and cost attribution of an hour."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from metering import ingest
from metering.models import HourlyRollup, UsageEvent
from metering.rollups import percentile_ms, recompute_hour
from serving.models import GpuClass, GpuPool
from tests.metering.helpers import event

HOUR = datetime(2026, 1, 1, tzinfo=UTC)


def _store(**fields: object) -> None:
    e = event(7, **fields)
    row = {k: getattr(e, k) for k in ingest.COLUMNS}
    row["started_at"] = datetime.fromtimestamp(e.started_at, UTC)
    row["ended_at"] = datetime.fromtimestamp(e.ended_at, UTC)
    UsageEvent.objects.create(**row)


@pytest.fixture
def pool(db: None) -> GpuPool:
    return GpuPool.objects.create(
        name="h100-east", gpu_class=GpuClass.objects.get(name="H100-SXM-80GB"), region="east"
    )


def test_recomputing_an_hour_twice_gives_the_same_rows(
    pool: GpuPool,
) -> None:
    for i in range(40):
        _store(total_ms=100.0 * (i + 1), price_charged_usd_micros=10)
    now = HOUR + timedelta(hours=2)
    recompute_hour(HOUR, now)
    first = list(HourlyRollup.objects.values())
    recompute_hour(HOUR, now)
    again = list(HourlyRollup.objects.values())
    strip = [{k: v for k, v in r.items() if k != "id"} for r in again]
    assert strip == [{k: v for k, v in r.items() if k != "id"} for r in first]
    [rollup] = HourlyRollup.objects.all()
    # "r1" is no replica the ledger knows: its requests are charged no GPU time
    assert rollup.cost_to_serve_usd_micros == 0
    assert (rollup.requests, rollup.revenue_usd_micros) == (40, 400)
    # the median, 2000 ms, falls in the [2000, 3000) bucket: reported as its upper bound
    assert percentile_ms(rollup.total_buckets, 0.5) == 3000
