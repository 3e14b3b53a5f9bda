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
import fcntl
import fnmatch
import logging
import os
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import orjson
import redis.asyncio as aioredis

from serving.router.contracts import DEFAULT_SLO_TIERS, slo_outcome, time_per_output_token

USAGE_STREAM = "usage:events"
# Approximate trimming (MAXLEN ~) keeps XADD O(1); the cap only bounds memory if ingest stops
# for a long time, it never drops what the consumer group has not yet read at normal rates.
USAGE_STREAM_MAXLEN = 5_000_000
EVENT_FIELD = b"e"
# The names the gateway gives its per-process spools (config.gateway), which
# `UsageSpool.adopt_orphans` looks for next to its own.
SPOOL_FAMILY = "usage-spool-*.jsonl"

log = logging.getLogger(__name__)

# ok: answered in full. client_cancelled: the client hung up. refused: the engine refused the
# request as the client wrote it (a 4xx of its own: longer than the model's context, a
# parameter it does not accept), the client's doing. upstream_failed: the replicas failed it.
# error: anything else the platform did not answer (no capacity, a queue timeout, a failure
# of the gateway's own).
Status = Literal["ok", "error", "client_cancelled", "refused", "upstream_failed"]
STATUSES: tuple[str, ...] = ("ok", "error", "client_cancelled", "refused", "upstream_failed")


class JudgedOnBothClocks:
    """A request's TPOT and its SLO outcome, from the fields a usage event and its row share
    (`ttft_ms`, `total_ms`, `completion_tokens`, `priority`, `status`)."""

    __slots__ = ()
    ttft_ms: float | None
    total_ms: float
    completion_tokens: int
    priority: str
    status: str

    @property
    def tpot_ms(self) -> float | None:
        """Its time per output token after the first, the SLO's second clock: (total - TTFT)
        over its completion tokens less one; None under two tokens or without a first token."""
        return time_per_output_token(self.ttft_ms, self.total_ms, self.completion_tokens)

    @property
    def slo_outcome(self) -> str | None:
        """met, ttft, tpot or failed against its tier's objectives (None: not judged;
        `serving.router.contracts.slo_outcome`)."""
        ttft_ms, tpot_ms = self.ttft_ms, self.tpot_ms
        return slo_outcome(
            DEFAULT_SLO_TIERS.get(self.priority),
            self.status,
            None if ttft_ms is None else ttft_ms / 1000,
            None if tpot_ms is None else tpot_ms / 1000,
        )


@dataclass(frozen=True, slots=True)
class UsageEvent(JudgedOnBothClocks):
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
    # Where the baseline policy (least load) would likely have sent the request, among the
    # same candidates at the same moment: metering prices the request's work there too.
    baseline_replica_id: str = ""
    baseline_pool: str = ""
    baseline_cost_usd_micros: int = 0  # priced later by metering.rollups, never by the gateway
    # The request's OpenTelemetry trace (32 hex digits), "" when tracing is off or not sampled.
    trace_id: str = ""
    # Where the prompt was prefilled for a disaggregated request (the prefill replica's router
    # id and its pool's name; replica_id and pool are then the decode replica's), "" otherwise.
    prefill_replica_id: str = ""
    prefill_pool: str = ""

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
    _add_entry(pipeline, event.to_json())


def _add_entry(pipeline: Any, raw_event: bytes) -> None:
    pipeline.xadd(
        USAGE_STREAM,
        {EVENT_FIELD: raw_event},
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

    Ownership: each process spools to its own file (the gateway names it by pid) and, from its
    first append or replay until it exits, holds an exclusive `flock` on `<spool>.lock`. The
    kernel drops the lock when the process dies however it dies, so a lock that another
    process can take means the owner is gone: `adopt_orphans` takes it, replays that spool
    and removes it. A new process whose pid (so whose file name) was reused inherits what its
    predecessor left and replays it as its own. Every path that opens a lock file checks after
    locking that the name still points at the file it locked, because an adopter unlinks a
    lock file once it is done. A spool written before locks existed has no lock file and
    reads as ownerless. Locks are local: the spool directory must be a local filesystem, and a
    child forked after the first append would share the parent's lock.

    Where it lives: `PLATFORM_VAR_DIR`. On Kubernetes that is an emptyDir, one per pod: it
    survives a container restart (the restarted gateway replays the file as its own when it
    gets the same pid, as PID 1 in its container does, and adopts it otherwise) but is
    deleted with the pod, and so is every event still spooled in it. What can be
    lost is therefore bounded by the events a pod spooled and could not replay before it was
    deleted, i.e. while Redis was still refusing them; the `UsageEventsSpooled` alert is the
    signal not to scale the gateway down or roll it until the spool has replayed.
    """

    REPLAY_CHUNK = 500

    def __init__(self, path: str | os.PathLike[str], *, family: str = SPOOL_FAMILY) -> None:
        self.path = Path(path)
        self.replaying_path = _replaying_path(self.path)
        self.lock_path = _lock_path(self.path)
        # Glob of the spool names in this directory that this process may adopt.
        self.family = family
        self._lock = threading.Lock()
        self._replay_lock = asyncio.Lock()
        self._owner_fd: int | None = None

    def claim(self) -> None:
        """Take the owner's lock, held until `release` or the process ends. Waits only while
        another process adopts a spool of the same name that a dead process left."""
        with self._lock:
            self._claim()

    def release(self) -> None:
        with self._lock:
            if self._owner_fd is not None:
                os.close(self._owner_fd)
                self._owner_fd = None

    def append(self, event: UsageEvent) -> None:
        line = event.to_json() + b"\n"
        with self._lock:
            self._claim()
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
        return sum(len(_read_lines(p)) for p in (self.replaying_path, self.path))

    async def replay(self, redis: aioredis.Redis | aioredis.RedisCluster) -> int:
        """Send spooled events to the stream; return how many were sent. Raises what Redis
        raises, leaving the unsent events spooled."""
        async with self._replay_lock:
            await asyncio.to_thread(self.claim)
            return await _replay(redis, self.path, self._lock, self.REPLAY_CHUNK)

    async def adopt_orphans(self, redis: aioredis.Redis | aioredis.RedisCluster) -> int:
        """Replay and remove the spools in this directory whose owner has exited; return how
        many events were sent. A spool whose owner is alive, or that another process is
        adopting, is left alone. Raises what Redis raises, leaving the unsent events spooled
        for the next attempt (by this process or another)."""
        sent = 0
        for name in await asyncio.to_thread(self._orphan_candidates):
            path = self.path.with_name(name)
            fd = _lock_file(_lock_path(path), wait=False)
            if fd is None:
                continue  # its owner is alive, or another process is adopting it
            try:
                count = await _replay(redis, path, threading.Lock(), self.REPLAY_CHUNK)
                if count:
                    log.warning("replayed %d usage events from %s, whose owner exited", count, name)
                sent += count
                # A leftover of a rewrite cut short (the aside file it was to replace is sent),
                # then the lock file, unlinked while we still hold its lock.
                _tmp_path(_replaying_path(path)).unlink(missing_ok=True)
                _lock_path(path).unlink(missing_ok=True)
            finally:
                os.close(fd)
        return sent

    def _orphan_candidates(self) -> list[str]:
        try:
            entries = os.listdir(self.path.parent)
        except FileNotFoundError:
            return []
        names = set()
        for entry in entries:
            name = entry
            for suffix in _SIDE_SUFFIXES:
                if name.endswith(suffix):
                    name = name[: -len(suffix)]
                    break
            if name != self.path.name and fnmatch.fnmatchcase(name, self.family):
                names.add(name)
        return sorted(names)

    def _claim(self) -> None:
        """Under self._lock."""
        if self._owner_fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._owner_fd = _lock_file(self.lock_path, wait=True)


_SIDE_SUFFIXES = (".lock", ".replaying.tmp", ".replaying")


def _replaying_path(path: Path) -> Path:
    return path.with_name(path.name + ".replaying")


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _tmp_path(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _lock_file(path: Path, *, wait: bool) -> int | None:
    """An open descriptor holding an exclusive flock on `path` (created if missing), or None
    when `wait` is false and another open file holds the lock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        locked = os.fstat(fd)
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and (current.st_dev, current.st_ino) == (
            locked.st_dev,
            locked.st_ino,
        ):
            return fd
        # An adopter unlinked the file between our open and our lock: lock the new one.
        os.close(fd)


async def _replay(
    redis: aioredis.Redis | aioredis.RedisCluster,
    path: Path,
    rotate_lock: threading.Lock,
    chunk_size: int,
) -> int:
    """Send the spool at `path`, its aside file first, until neither is left."""
    replaying = _replaying_path(path)
    sent = 0
    while await asyncio.to_thread(_rotate, path, replaying, rotate_lock):
        lines = await asyncio.to_thread(_read_lines, replaying)
        while True:
            chunk, lines = lines[:chunk_size], lines[chunk_size:]
            if chunk:
                pipeline = redis.pipeline(transaction=False)
                for line in chunk:
                    # As spooled: ingest validates, and sets aside an entry that does not parse.
                    _add_entry(pipeline, line)
                await pipeline.execute()
                sent += len(chunk)
            # Also when nothing was sent: a file of nothing but a torn line is done with.
            await asyncio.to_thread(_rewrite_replaying, replaying, lines)
            if not lines:
                break
    return sent


def _rotate(path: Path, replaying: Path, rotate_lock: threading.Lock) -> bool:
    """Whether an aside file is there to send, after moving the spool aside if there was none."""
    with rotate_lock:
        if replaying.exists():
            return True
        if not path.exists():
            return False
        os.replace(path, replaying)
        return True


def _rewrite_replaying(replaying: Path, lines: list[bytes]) -> None:
    if not lines:
        replaying.unlink(missing_ok=True)
        return
    tmp = _tmp_path(replaying)
    with tmp.open("wb") as f:
        f.write(b"".join(line + b"\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, replaying)


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
