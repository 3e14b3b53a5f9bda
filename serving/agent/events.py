"""Replica events kept until a heartbeat has delivered them (at least once: the control plane
may see one twice after a lost response, and can drop repeats by event_id)."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EVENT_KINDS = frozenset({"started", "ready", "crashed", "restarted", "stopped", "failed"})

# A node cut off from its control plane for hours must not grow without bound; the oldest
# events go first because the replica states sent with every heartbeat carry the latest truth.
MAX_PENDING_EVENTS = 10_000


@dataclass(frozen=True, slots=True)
class ReplicaEvent:
    replica_id: str
    kind: str
    message: str
    at: float = field(default_factory=time.time)
    event_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def to_json(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "replica_id": self.replica_id,
            "kind": self.kind,
            "message": self.message,
            "at": self.at,
        }


class EventQueue:
    def __init__(self, limit: int = MAX_PENDING_EVENTS) -> None:
        self._pending: list[ReplicaEvent] = []
        self._limit = limit

    def emit(self, replica_id: str, kind: str, message: str) -> ReplicaEvent:
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown replica event kind {kind!r}")
        event = ReplicaEvent(replica_id=replica_id, kind=kind, message=message)
        self._pending.append(event)
        del self._pending[: max(0, len(self._pending) - self._limit)]
        return event

    def pending(self) -> list[ReplicaEvent]:
        return list(self._pending)

    def save(self, path: Path) -> None:
        """Keep what is still undelivered for the next start (the agent is stopping): a
        replica's `stopped` must reach the control plane even when it is down first, or the
        GPU-time ledger would count the replica ready until the agent came back."""
        if not self._pending:
            path.unlink(missing_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(".tmp")
        staging.write_text(json.dumps([event.to_json() for event in self._pending]))
        os.replace(staging, path)

    def restore(self, path: Path) -> int:
        """Put back what `save` kept, ahead of anything emitted since; returns how many."""
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError):
            log.warning("undelivered events in %s do not parse; dropped", path)
            path.unlink(missing_ok=True)
            return 0
        kept = [
            ReplicaEvent(
                replica_id=str(item["replica_id"]),
                kind=str(item["kind"]),
                message=str(item.get("message") or ""),
                at=float(item["at"]),
                event_id=str(item["event_id"]),
            )
            for item in raw
            if isinstance(item, dict) and {"replica_id", "kind", "at", "event_id"} <= set(item)
        ]
        self._pending = [*kept, *self._pending][-self._limit :]
        path.unlink(missing_ok=True)
        return len(kept)

    def acknowledge(self, delivered: list[ReplicaEvent]) -> None:
        """Drop what a heartbeat delivered; events emitted while it was in flight stay."""
        sent = {event.event_id for event in delivered}
        self._pending = [event for event in self._pending if event.event_id not in sent]
