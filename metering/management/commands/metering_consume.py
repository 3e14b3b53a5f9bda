"""Run one usage-stream consumer in a loop (outside Celery; also what the crash tests kill)."""

from __future__ import annotations

import sys
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from config.redis import redis_client
from metering import ingest


class Command(BaseCommand):
    help = "Drain usage:events into PostgreSQL until stopped (or until empty with --until-empty)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", default=ingest.consumer_name())
        parser.add_argument("--batch", type=int, default=ingest.BATCH_SIZE)
        parser.add_argument("--min-idle-ms", type=int, default=ingest.MIN_IDLE_MS)
        parser.add_argument("--until-empty", action="store_true")
        parser.add_argument(
            "--hold-ms",
            type=int,
            default=0,
            help="Pause before each commit and before each ack (lets a test kill mid-batch).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        hold_s = options["hold_ms"] / 1000

        def announce(phase: str) -> Any:
            def hook(rows: int) -> None:
                sys.stdout.write(f"{phase} {rows}\n")
                sys.stdout.flush()
                time.sleep(hold_s)

            return hook

        consumer = ingest.Consumer(
            redis_client(worker=True),
            options["name"],
            batch_size=options["batch"],
            min_idle_ms=options["min_idle_ms"],
            before_commit=announce("inserted") if hold_s else None,
            before_ack=announce("committed") if hold_s else None,
        )
        while True:
            result = consumer.drain(max_seconds=5.0, block_ms=0 if options["until_empty"] else 1000)
            if options["until_empty"] and result.read == 0:
                sys.stdout.write("empty\n")
                return
