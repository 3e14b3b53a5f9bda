"""Events ingested per second from the usage stream into PostgreSQL.

Run: DEBUG=1 .venv/bin/python bench/metering.py [events] [batch]
Uses a scratch tenant id and deletes its rows afterwards; the stream and group it uses are the
real ones, so run it against a development Redis DB, not production.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django

django.setup()

import redis  # noqa: E402
from django.conf import settings  # noqa: E402

from metering import ingest  # noqa: E402
from metering.models import UsageEvent as Row  # noqa: E402
from metering.usage import UsageEvent, add_usage_event  # noqa: E402

SCRATCH_TENANT = -424242


def make_events(n: int, run: str) -> list[UsageEvent]:
    start = time.time()
    return [
        UsageEvent(
            f"bench-{run}-{i}",
            SCRATCH_TENANT,
            1,
            "llama-3.1-8b",
            None,
            "",
            None,
            "h100-east",
            f"r{i % 16}",
            "standard",
            500 + i % 700,
            i % 200,
            50 + i % 300,
            "ok",
            "stop",
            1.0,
            90.0,
            1200.0,
            start + i * 1e-4,
            start + i * 1e-4 + 1.2,
        )
        for i in range(n)
    ]


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else ingest.BATCH_SIZE
    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=30)
    run = str(int(time.time()))
    events = make_events(total, run)
    t0 = time.perf_counter()
    for i in range(0, total, 5000):
        pipe = client.pipeline(transaction=False)
        for e in events[i : i + 5000]:
            add_usage_event(pipe, e)
        pipe.execute()
    xadd_s = time.perf_counter() - t0
    consumer = ingest.Consumer(client, f"bench-{run}", batch_size=batch)
    t0 = time.perf_counter()
    result = consumer.drain(max_seconds=600)
    ingest_s = time.perf_counter() - t0
    stored = Row.objects.filter(tenant_id=SCRATCH_TENANT, request_id__startswith=f"bench-{run}-")
    count = stored.count()
    stored.delete()
    print(f"{'stage':<28}{'events':>10}{'seconds':>10}{'events/s':>12}")
    print(f"{'XADD (pipelined, 1 client)':<28}{total:>10}{xadd_s:>10.2f}{total / xadd_s:>12,.0f}")
    print(
        f"{'ingest to PostgreSQL':<28}{result.inserted:>10}{ingest_s:>10.2f}{result.inserted / ingest_s:>12,.0f}"
    )
    print(f"batch size {batch}, {result.batches} batches; rows found after: {count}")


if __name__ == "__main__":
    main()
