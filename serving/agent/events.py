"""Replica events kept until a heartbeat has delivered them (at least once: the control plane
may see one twice after a lost response, and can drop repeats by event_id)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

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

    def acknowledge(self, delivered: list[ReplicaEvent]) -> None:
        """Drop what a heartbeat delivered; events emitted while it was in flight stay."""
        sent = {event.event_id for event in delivered}
        self._pending = [event for event in self._pending if event.event_id not in sent]
