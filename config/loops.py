"""One item's failure in a control loop is that item's alone.

The control loops walk every deployment, rollout or tenant on a beat: reconcile, the routing
table's publication, the autoscaler, the rollout controller, invoices and budget checks. One
item's exception used to end the pass for all of them: a model of 0 KV heads, once deployed,
divided by zero in each fleet loop, and no replica was placed, no table published and nothing
scaled anywhere until that row was fixed. Now each item runs in its own savepoint
(`LoopPass.item`): its exception is logged with its traceback, its writes roll back, and the
pass goes on with the next item.

The pass's failures are kept in Redis (`LOOP_FAILURES_KEY`, one hash field per loop and
item) until a pass of the same loop no longer fails on that item, with the time the failure
was first seen, for the console and the API to show beside the deployment or rollout, and
for the gateways to count into `platform_control_loop_failures` (alert `ControlLoopFailing`).
Each pass also stamps when it ended (`LOOP_PASSES_KEY`), which the gateways export as
`platform_control_loop_last_pass_timestamp_seconds`: a loop that stopped running at all (no
worker, no beat) raises `ControlLoopStalled`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
import redis
from django.db import transaction

from serving.redis_contracts import LOOP_FAILURES_KEY, LOOP_PASSES_KEY
from serving.redis_contracts import text as redis_text

logger = logging.getLogger(__name__)

# What is kept of an exception's text: enough to recognise it, not a page of it.
ERROR_CHARS = 500


@dataclass(frozen=True, slots=True)
class LoopFailure:
    """A loop that failed on one item, since `since` (epoch seconds) and on its last pass."""

    loop: str
    kind: str
    item_id: int
    error: str
    since: float

    @property
    def since_at(self) -> datetime:
        return datetime.fromtimestamp(self.since, UTC)


class LoopPass:
    """One pass of a loop named `loop` over items of one `kind` ("deployment", "rollout",
    "tenant")."""

    def __init__(self, loop: str, kind: str) -> None:
        if ":" in loop or ":" in kind:
            raise ValueError("a loop's name and kind are the hash field's parts: no ':'")
        self.loop = loop
        self.kind = kind
        self.failed: dict[int, str] = {}
        # Items this pass did not look at (another worker held them): their stored failure,
        # if any, stays as it was.
        self.left: set[int] = set()

    def leave_as_was(self, item_id: int) -> None:
        self.left.add(item_id)

    @contextmanager
    def item(self, item_id: int, *, savepoint: bool = True) -> Iterator[None]:
        """Run one item's work in a savepoint; an exception there is logged, noted and
        swallowed, and the item's writes are rolled back. `savepoint=False` for work that
        commits as it goes because it acts outside the database between writes (a budget
        alert is recorded, then mailed: rolling the record back would mail it again)."""
        try:
            with transaction.atomic() if savepoint else nullcontext():
                yield
        except Exception as error:
            logger.exception(
                "%s: %s %s failed; the pass goes on with the others", self.loop, self.kind, item_id
            )
            self.failed[item_id] = f"{type(error).__name__}: {error}"[:ERROR_CHARS]

    def record(self, client: redis.Redis) -> None:
        """Store this pass's failures in place of the loop's last ones, keeping when each was
        first seen, and when the pass ended. A Redis error is logged, never raised: the
        pass's work is done."""
        prefix = f"{self.loop}:{self.kind}:"
        try:
            stored = {
                redis_text(name): redis_text(raw)
                for name, raw in client.hgetall(LOOP_FAILURES_KEY).items()
                if redis_text(name).startswith(prefix)
            }
            now = time.time()
            current: dict[str, bytes] = {}
            for item_id, error in self.failed.items():
                field = f"{prefix}{item_id}"
                since = orjson.loads(stored[field])["since"] if field in stored else now
                current[field] = orjson.dumps({"error": error, "since": since})
            left = {f"{prefix}{item_id}" for item_id in self.left}
            gone = [field for field in stored if field not in current and field not in left]
            pipe = client.pipeline(transaction=False)
            pipe.hset(LOOP_PASSES_KEY, self.loop, now)  # a pass ended: the loop runs
            if gone:
                pipe.hdel(LOOP_FAILURES_KEY, *gone)
            if current:
                pipe.hset(LOOP_FAILURES_KEY, mapping=current)  # type: ignore[arg-type]
            pipe.execute()
        except redis.RedisError:
            logger.warning("%s: its failures could not be stored", self.loop, exc_info=True)


def loop_failures(client: redis.Redis, kind: str) -> dict[int, list[LoopFailure]]:
    """Every loop's standing failures on items of `kind`, by item id; empty when Redis is
    away (the page that shows them still renders)."""
    try:
        stored = client.hgetall(LOOP_FAILURES_KEY)
    except redis.RedisError:
        logger.warning("loop failures unreadable", exc_info=True)
        return {}
    failures: dict[int, list[LoopFailure]] = {}
    for name, raw in stored.items():
        parts = redis_text(name).rsplit(":", 2)
        if len(parts) != 3 or parts[1] != kind or not parts[2].isascii() or not parts[2].isdigit():
            continue
        try:
            body: dict[str, Any] = orjson.loads(raw)
            failure = LoopFailure(
                parts[0], kind, int(parts[2]), str(body["error"]), float(body["since"])
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            logger.warning("loop failure %r unreadable: %r", name, raw)
            continue
        failures.setdefault(failure.item_id, []).append(failure)
    for listed in failures.values():
        listed.sort(key=lambda failure: failure.loop)
    return failures
