"""Drain the usage stream into PostgreSQL, exactly once.

A Redis consumer group (`metering`) hands each stream entry to one consumer. A consumer reads a
batch, bills every event at the price in force when it started, COPYs the batch into a
per-session temporary table and inserts it with `ON CONFLICT (request_id, started_at) DO
NOTHING` (the key of the table partitioned by month; a replayed event carries the same
`started_at`, so it meets its first copy: metering.partitions), commits, and only then
acknowledges the entries. So:

- a consumer killed before its commit leaves the entries pending and nothing in PostgreSQL;
- a consumer killed after its commit but before its ack leaves them pending too, and the
  re-insert after reclaim is a no-op on the unique request id;
- entries left pending by a dead consumer are taken over with XAUTOCLAIM once idle for
  `min_idle_ms`; a restarted consumer with the same name first re-reads its own pending list.

Consumer names carry the process id, so every restart leaves a name behind in the group. At
the end of each drain a consumer removes the others that have been idle for `dead_after_ms`
and hold no pending entries (one Lua call, so none can read an entry between the check and
the XGROUP DELCONSUMER, which would drop it). One that still holds entries stays until they
have been claimed. A live consumer removed while it sat idle loses nothing: its next read
adds it back.

Price: ingest is the biller of record. It re-prices each event from the price sheets in
PostgreSQL at the event's start time; the gateway's figure (from the book it cached from
Redis) fed the live spend counter only. An event whose model has no sheet keeps the gateway's
figure.

Entries that do not parse are moved to `usage:events:dead` and acknowledged, so one bad entry
cannot wedge the group.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
import redis as redis_lib
from django.db import connection, transaction
from redis.typing import EncodableT, FieldT

from metering import usage
from metering.prices import build_price_book
from metering.pricing import PriceBook, PriceNotFound, charge_usd_micros

logger = logging.getLogger(__name__)

GROUP = "metering"
DEAD_STREAM = "usage:events:dead"
BATCH_SIZE = 5000
MIN_IDLE_MS = 30_000
# Far longer than any live consumer waits between reads (every second, or 1 s blocks).
DEAD_CONSUMER_IDLE_MS = 600_000

# KEYS[1] the stream; ARGV[1] the group, ARGV[2] the caller (kept), ARGV[3] idle ms.
# Returns the names removed.
_REMOVE_DEAD_CONSUMERS = """
local removed = {}
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #consumer, 2 do info[consumer[i]] = consumer[i + 1] end
  if info.name ~= ARGV[2] and info.pending == 0 and info.idle >= tonumber(ARGV[3]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info.name)
    removed[#removed + 1] = info.name
  end
end
return removed
"""

COLUMNS: tuple[str, ...] = (
    "request_id",
    "tenant_id",
    "key_id",
    "model",
    "version_id",
    "adapter",
    "deployment_id",
    "pool",
    "replica_id",
    "priority",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "status",
    "finish_reason",
    "queue_ms",
    "ttft_ms",
    "total_ms",
    "gpu_seconds",
    "cost_to_serve_usd_micros",
    "price_charged_usd_micros",
    "started_at",
    "ended_at",
    "baseline_replica_id",
    "baseline_pool",
    "baseline_cost_usd_micros",
    "trace_id",
    "prefill_replica_id",
    "prefill_pool",
)
# Columns the gateway may leave unset or an older gateway did not send; every other one must be there.
_DEFAULTS: dict[str, object] = {
    "gpu_seconds": 0.0,
    "cost_to_serve_usd_micros": 0,
    "baseline_replica_id": "",
    "baseline_pool": "",
    "baseline_cost_usd_micros": 0,
    "trace_id": "",
    "prefill_replica_id": "",
    "prefill_pool": "",
}
_DEFAULTED = frozenset(COLUMNS) - set(_DEFAULTS)

_STAGING_DDL = (
    "CREATE TEMP TABLE IF NOT EXISTS metering_usage_staging "
    "(LIKE metering_usageevent INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
)
_COPY = f"COPY metering_usage_staging ({', '.join(COLUMNS)}) FROM STDIN"
# From the constant COLUMNS, never from input.
_INSERT = (
    f"INSERT INTO metering_usageevent ({', '.join(COLUMNS)}) "  # nosec B608
    f"SELECT {', '.join(COLUMNS)} FROM metering_usage_staging "
    "ON CONFLICT (request_id, started_at) DO NOTHING"
)

Entry = tuple[bytes, dict[bytes, bytes]]


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def ensure_group(client: redis_lib.Redis) -> None:
    try:
        # "0": a group created after the gateway started still reads everything in the stream.
        client.xgroup_create(usage.USAGE_STREAM, GROUP, id="0", mkstream=True)
    except redis_lib.ResponseError as error:
        if "BUSYGROUP" not in str(error):
            raise


@dataclass
class DrainResult:
    read: int = 0
    inserted: int = 0
    dead: int = 0
    batches: int = 0


@dataclass
class Consumer:
    """One named member of the group. `hooks` let a test pause inside a batch."""

    client: redis_lib.Redis
    name: str
    batch_size: int = BATCH_SIZE
    min_idle_ms: int = MIN_IDLE_MS
    dead_after_ms: int = DEAD_CONSUMER_IDLE_MS
    before_commit: Callable[[int], None] | None = None
    before_ack: Callable[[int], None] | None = None
    _own_pending_done: bool = False
    _book: PriceBook | None = None

    def drain(self, *, max_seconds: float = 1.0, block_ms: int = 0) -> DrainResult:
        """Process batches until the stream has nothing for us or time is up."""
        ensure_group(self.client)
        self._book = build_price_book()
        result = DrainResult()
        deadline = time.monotonic() + max_seconds
        while True:
            entries = self._next_batch(block_ms)
            if not entries:
                break
            self._process(entries, result)
            if time.monotonic() >= deadline:
                break
        self.remove_dead_consumers()
        return result

    def remove_dead_consumers(self) -> list[str]:
        """Remove the group's other consumers idle for `dead_after_ms` with nothing pending;
        returns their names."""
        remove = self.client.register_script(_REMOVE_DEAD_CONSUMERS)
        removed = remove(keys=[usage.USAGE_STREAM], args=[GROUP, self.name, self.dead_after_ms])
        names = [name.decode() for name in removed]
        if names:
            logger.info("removed %d dead usage consumers: %s", len(names), ", ".join(names))
        return names

    def _next_batch(self, block_ms: int) -> list[Entry]:
        if not self._own_pending_done:
            # After a restart under the same name: what we read but never acked comes first.
            own = self._read("0", None)
            if own:
                return own
            self._own_pending_done = True
        _next, claimed, *_deleted = self.client.xautoclaim(
            usage.USAGE_STREAM, GROUP, self.name, self.min_idle_ms, "0-0", count=self.batch_size
        )
        if claimed:
            logger.info("reclaimed %d idle usage entries", len(claimed))
            return [e for e in claimed if e[1]]
        return self._read(">", block_ms or None)

    def _read(self, stream_id: str, block_ms: int | None) -> list[Entry]:
        answer = self.client.xreadgroup(
            GROUP, self.name, {usage.USAGE_STREAM: stream_id}, count=self.batch_size, block=block_ms
        )
        if not answer:
            return []
        # RESP2, this client's protocol: [[stream name, [(entry id, fields), ...]]].
        assert isinstance(answer, list)
        return [e for e in answer[0][1] if e[1]]

    def _process(self, entries: Sequence[Entry], result: DrainResult) -> None:
        rows, dead = self._rows(entries)
        ids = [entry_id for entry_id, _ in entries]
        with transaction.atomic():
            inserted = insert_rows(rows)
            if self.before_commit:
                self.before_commit(len(rows))
        if self.before_ack:
            self.before_ack(len(rows))
        if dead:
            pipe = self.client.pipeline(transaction=False)
            for entry_id, fields in dead:
                pipe.xadd(DEAD_STREAM, _dead_entry(entry_id, fields), maxlen=100_000)
            pipe.execute()
        self.client.xack(usage.USAGE_STREAM, GROUP, *ids)
        result.read += len(entries)
        result.inserted += inserted
        result.dead += len(dead)
        result.batches += 1

    def _rows(self, entries: Sequence[Entry]) -> tuple[list[tuple[object, ...]], list[Entry]]:
        rows: list[tuple[object, ...]] = []
        dead: list[Entry] = []
        for entry in entries:
            try:
                rows.append(self._row(orjson.loads(entry[1][usage.EVENT_FIELD])))
            except (KeyError, TypeError, ValueError, orjson.JSONDecodeError):
                logger.warning("usage entry %r does not parse; moved to %s", entry[0], DEAD_STREAM)
                dead.append(entry)
        return rows, dead

    def _row(self, event: dict[str, Any]) -> tuple[object, ...]:
        """The event's COPY row; a plain dict, not a UsageEvent, because this runs for every
        event at tens of thousands a second. A missing field raises KeyError (dead entry)."""
        event["price_charged_usd_micros"] = self._price(event)
        event["started_at"] = _timestamp(event["started_at"])
        event["ended_at"] = _timestamp(event["ended_at"])
        return tuple(event[c] if c in _DEFAULTED else event.get(c, _DEFAULTS[c]) for c in COLUMNS)

    def _price(self, event: dict[str, Any]) -> int:
        assert self._book is not None
        try:
            price = self._book.price_for(
                event["model"],
                event["adapter"],
                event["priority"],
                event["tenant_id"],
                event["started_at"],
            )
        except PriceNotFound:
            return int(event.get("price_charged_usd_micros", 0))
        return charge_usd_micros(
            price,
            event["prompt_tokens"],
            event["cached_prompt_tokens"],
            event["completion_tokens"],
        )


def _dead_entry(entry_id: bytes, fields: dict[bytes, bytes]) -> dict[FieldT, EncodableT]:
    """The fields of a dead entry: the id it had on the usage stream, then its own fields."""
    dead: dict[FieldT, EncodableT] = {b"id": entry_id}
    dead.update(fields.items())
    return dead


def _timestamp(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


def insert_rows(rows: Sequence[tuple[object, ...]]) -> int:
    """COPY rows into the staging table and move the new ones into the events table; returns
    how many were new. Must run inside a transaction (the staging rows vanish at commit)."""
    if not rows:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(_STAGING_DDL)
        # ON COMMIT empties it, but a batch inside an outer transaction (a savepoint) would
        # otherwise see the previous batch's rows.
        cursor.execute("TRUNCATE metering_usage_staging")
        with cursor.cursor.copy(_COPY) as copy:
            for row in rows:
                copy.write_row(row)
        cursor.execute(_INSERT)
        return int(cursor.rowcount)
