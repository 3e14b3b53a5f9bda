"""The usage event: one per request, written once by the gateway at settle.

No Django here: the gateway imports this on the hot path. The event travels as one stream
entry on `usage:events` whose single field `e` holds the event as JSON; the metering ingest
drains the stream into PostgreSQL where the request id is unique, so writing an event twice
(a retried settle, a spool replay) bills it once.

Identifier types: tenant, key, version and deployment ids are the integer primary keys of
their rows; the pool is the pool's name and the replica id is the router's string id.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import orjson

USAGE_STREAM = "usage:events"
# Approximate trimming (MAXLEN ~) keeps XADD O(1); the cap only bounds memory if ingest stops
# for a long time, it never drops what the consumer group has not yet read at normal rates.
USAGE_STREAM_MAXLEN = 5_000_000
EVENT_FIELD = b"e"

Status = Literal["ok", "error", "client_cancelled", "upstream_failed"]
STATUSES: tuple[str, ...] = ("ok", "error", "client_cancelled", "upstream_failed")


@dataclass(slots=True)
class UsageEvent:
    request_id: str
    tenant_id: int
    key_id: int | None
    model: str
    version_id: int | None
    adapter: str
    deployment_id: int | None
    pool: str
    replica_id: str
    priority: str
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    status: Status
    finish_reason: str
    queue_ms: float
    ttft_ms: float | None
    total_ms: float
    started_at: float
    ended_at: float
    gpu_seconds: float = 0.0  # attributed later by metering.cost, never by the gateway
    cost_to_serve_usd_micros: int = 0  # likewise
    price_charged_usd_micros: int = 0

    def to_json(self) -> bytes:
        # orjson serializes a dataclass natively, several times faster than asdict().
        return orjson.dumps(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> UsageEvent:
        data: dict[str, Any] = orjson.loads(raw)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UsageEvent:
        # Unknown keys are dropped so an older consumer reads a newer gateway's events.
        return cls(**{name: data[name] for name in _FIELD_NAMES if name in data})


_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(UsageEvent))


def add_usage_event(pipeline: Any, event: UsageEvent) -> None:
    """Queue the XADD of `event` on a redis-py (asyncio) pipeline: the gateway's settle sends
    it together with its refund and slot release in one round trip."""
    pipeline.xadd(
        USAGE_STREAM,
        {EVENT_FIELD: event.to_json()},
        maxlen=USAGE_STREAM_MAXLEN,
        approximate=True,
    )


class UsageSpool:
    """A local append-only file of events that Redis refused, replayed when it is back.

    One JSON event a line, fsync'd before `append` returns, so an event survives a crash of
    the gateway right after settle. Replay first renames the spool aside (appends then go to a
    fresh file), sends it in chunks, and after each chunk rewrites the aside file with what is
    left: a replay cut short resumes where it stopped, and resending a chunk is harmless
    because ingest keeps the first row per request id.
    """

    REPLAY_CHUNK = 500

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.replaying_path = self.path.with_name(self.path.name + ".replaying")
        self._lock = threading.Lock()
        self._replay_lock = asyncio.Lock()

    def append(self, event: UsageEvent) -> None:
        line = event.to_json() + b"\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    # A torn line from a crash: end it, or this event would be glued to it.
                    line = b"\n" + line
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)

    async def append_async(self, event: UsageEvent) -> None:
        """fsync blocks; keep it off the event loop."""
        await asyncio.to_thread(self.append, event)

    def has_pending(self) -> bool:
        """Cheap: whether anything is spooled (no file read), for a frequent check."""
        return any(
            path.exists() and path.stat().st_size > 0 for path in (self.replaying_path, self.path)
        )

    def pending(self) -> int:
        return sum(len(self._read_lines(p)) for p in (self.replaying_path, self.path))

    async def replay(self, redis: Any) -> int:
        """Send spooled events to the stream; return how many were sent. Raises what Redis
        raises, leaving the unsent events spooled."""
        async with self._replay_lock:
            with self._lock:
                if not self.replaying_path.exists() and self.path.exists():
                    os.replace(self.path, self.replaying_path)
            lines = await asyncio.to_thread(self._read_lines, self.replaying_path)
            sent = 0
            while lines:
                chunk, rest = lines[: self.REPLAY_CHUNK], lines[self.REPLAY_CHUNK :]
                pipeline = redis.pipeline(transaction=False)
                for line in chunk:
                    add_usage_event(pipeline, UsageEvent.from_json(line))
                await pipeline.execute()
                sent += len(chunk)
                lines = rest
                await asyncio.to_thread(self._rewrite_replaying, lines)
            return sent

    def _rewrite_replaying(self, lines: list[bytes]) -> None:
        if not lines:
            self.replaying_path.unlink(missing_ok=True)
            return
        tmp = self.replaying_path.with_name(self.replaying_path.name + ".tmp")
        with tmp.open("wb") as f:
            f.write(b"".join(line + b"\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.replaying_path)

    @staticmethod
    def _read_lines(path: Path) -> list[bytes]:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return []
        # A crash mid-append can leave a torn last line without its newline: drop it, it was
        # never acknowledged to the caller (append returns only after fsync of a full line).
        # A torn line that a later append ended reads as one corrupt line: skip it.
        return [line for line in raw.split(b"\n")[:-1] if _parses(line)]


def _parses(line: bytes) -> bool:
    try:
        orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return True
