"""Usage events into PostgreSQL: throughput with several consumers, and lag under overload.

Run: DEBUG=1 .venv/bin/python bench/metering.py [--events N] [--consumers C] [--sustain-s S]
     [--rate-factor F] [--batch B]

1. Burst: N events are put on the stream, then 1 consumer and then C consumer processes drain
   it (side by side in one run): events per second into PostgreSQL for each.
2. Sustained: a producer adds events at F times the C consumers' burst rate (or as fast as it
   can, which the table says) for S seconds while the C consumers run; the group's lag is
   sampled every 0.5 s. The table gives the rate offered, the peak lag, how long the consumers
   took to catch up once the load stopped, and whether every event produced is in PostgreSQL
   exactly once (nothing lost, nothing doubled).

Uses a scratch tenant id and deletes its rows afterwards; the stream and group are the real
ones, so run it against a development Redis and database, not production.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django

django.setup()

import redis  # noqa: E402
from django.conf import settings  # noqa: E402

from metering import ingest  # noqa: E402
from metering.models import UsageEvent as Row  # noqa: E402
from metering.usage import USAGE_STREAM, UsageEvent, add_usage_event  # noqa: E402

SCRATCH_TENANT = -424242
CHUNK = 2000


def make_event(run: str, i: int, start: float) -> UsageEvent:
    return UsageEvent(
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


def client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=30)


def produce(conn: redis.Redis, run: str, first: int, count: int, start: float) -> None:
    pipe = conn.pipeline(transaction=False)
    for i in range(first, first + count):
        add_usage_event(pipe, make_event(run, i, start))
    pipe.execute()


def lag(conn: redis.Redis) -> int:
    """Entries the group has not yet delivered plus those delivered and not acknowledged."""
    for group in conn.xinfo_groups(USAGE_STREAM):
        if group["name"] in (ingest.GROUP, ingest.GROUP.encode()):
            undelivered = group.get("lag")
            if undelivered is None:  # Redis cannot tell after some trims: count it
                undelivered = conn.xlen(USAGE_STREAM)
            return int(undelivered) + int(group["pending"])
    return conn.xlen(USAGE_STREAM)


def consume(name: str, ready: EventType, go: EventType, stop: EventType, batch: int) -> None:
    """A consumer process: set up, says so, waits for the start, then drains until told to
    stop and the group has nothing left."""
    django.setup()
    from django.db import connection

    conn = client()
    consumer = ingest.Consumer(conn, name, batch_size=batch)
    connection.ensure_connection()
    ready.set()
    go.wait()
    while True:
        result = consumer.drain(max_seconds=0.5)
        if stop.is_set() and result.inserted == 0 and lag(conn) == 0:
            return


class Consumers:
    """`count` consumer processes, started and set up (Django imported, connections open), held
    until `go()` so that their start-up is not timed."""

    def __init__(self, count: int, batch: int, tag: str) -> None:
        context = mp.get_context("spawn")
        self.go_event, self.stop_event = context.Event(), context.Event()
        ready = [context.Event() for _ in range(count)]
        self.processes = [
            context.Process(
                target=consume,
                args=(f"bench-{tag}-{n}", ready[n], self.go_event, self.stop_event, batch),
                daemon=True,
            )
            for n in range(count)
        ]
        for process in self.processes:
            process.start()
        for each in ready:
            each.wait(timeout=120)

    def go(self) -> None:
        self.go_event.set()

    def finish(self) -> None:
        self.stop_event.set()
        for process in self.processes:
            process.join(timeout=600)


def stored(run: str) -> int:
    return Row.objects.filter(
        tenant_id=SCRATCH_TENANT, request_id__startswith=f"bench-{run}-"
    ).count()


def cleanup(run: str) -> None:
    Row.objects.filter(tenant_id=SCRATCH_TENANT, request_id__startswith=f"bench-{run}-").delete()


def burst(conn: redis.Redis, events: int, consumers: int, batch: int) -> tuple[float, int]:
    run = f"{int(time.time() * 1000)}b{consumers}"
    start = time.time()
    for first in range(0, events, CHUNK):
        produce(conn, run, first, min(CHUNK, events - first), start)
    pool = Consumers(consumers, batch, run)
    t0 = time.perf_counter()
    pool.go()
    while lag(conn) > 0:
        time.sleep(0.05)
    seconds = time.perf_counter() - t0
    pool.finish()
    found = stored(run)
    cleanup(run)
    return events / seconds, found


def sustained(
    conn: redis.Redis, rate: float, seconds: float, consumers: int, batch: int
) -> dict[str, float]:
    run = f"{int(time.time() * 1000)}s"
    pool = Consumers(consumers, batch, run)
    pool.go()
    samples: list[int] = []
    sampling = threading.Event()

    def sample() -> None:
        probe = client()
        while not sampling.is_set():
            samples.append(lag(probe))
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.time()
    t0 = time.perf_counter()
    produced = 0
    tick = 0.1
    while (elapsed := time.perf_counter() - t0) < seconds:
        # At most one tick's worth at a time: a producer that falls behind offers less, and
        # the load still ends on time (the table gives the rate it reached).
        due = min(int(rate * (elapsed + tick)) - produced, max(1, int(rate * tick)))
        if due > 0:
            produce(conn, run, produced, due, start)
            produced += due
        pause = t0 + (produced / rate) - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    load_s = time.perf_counter() - t0
    end_lag = lag(conn)
    t1 = time.perf_counter()
    while lag(conn) > 0:
        time.sleep(0.05)
    catch_up_s = time.perf_counter() - t1
    sampling.set()
    sampler.join()
    pool.finish()
    found = stored(run)
    cleanup(run)
    return {
        "offered": produced / load_s,
        "produced": produced,
        "peak_lag": max([*samples, end_lag]),
        "end_lag": end_lag,
        "catch_up_s": catch_up_s,
        "stored": found,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--sustain-s", type=float, default=60.0)
    parser.add_argument("--rate-factor", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=ingest.BATCH_SIZE)
    args = parser.parse_args()
    conn = client()
    ingest.ensure_group(conn)

    print(f"burst: {args.events:,} events on the stream, then drained\n")
    print(f"{'consumers':<12}{'events/s':>12}{'stored':>10}")
    rates = {}
    for count in sorted({1, args.consumers}):
        rates[count], found = burst(conn, args.events, count, args.batch)
        print(f"{count:<12}{rates[count]:>12,.0f}{found:>10,}")

    rate = args.rate_factor * rates[args.consumers]
    print(
        f"\nsustained: {args.rate_factor:g} x the {args.consumers} consumers' rate "
        f"({rate:,.0f}/s asked) for {args.sustain_s:g} s\n"
    )
    result = sustained(conn, rate, args.sustain_s, args.consumers, args.batch)
    print(
        f"{'offered/s':>10}{'produced':>10}{'peak lag':>10}{'lag at end':>12}"
        f"{'catch-up s':>12}{'stored':>10}{'lost':>6}"
    )
    lost = result["produced"] - result["stored"]
    print(
        f"{result['offered']:>10,.0f}{result['produced']:>10,.0f}{result['peak_lag']:>10,.0f}"
        f"{result['end_lag']:>12,.0f}{result['catch_up_s']:>12.1f}{result['stored']:>10,.0f}"
        f"{lost:>6,.0f}"
    )
    print(
        f"\nbatch size {args.batch}; {os.cpu_count()} CPUs shared by producer, consumers, "
        "Redis and PostgreSQL"
    )


if __name__ == "__main__":
    main()
