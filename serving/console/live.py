"""The console overview's live picture: one fleet snapshot, sent to every open overview page
through the `fleet-live` channel group (serving/console/consumers.py)."""

from __future__ import annotations

from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from config.redis import redis_client
from serving.console.queries import fleet_snapshot, record_fleet_history

FLEET_GROUP = "fleet-live"


def publish_fleet_snapshot() -> dict[str, Any]:
    """Build one snapshot, add its point to the chart's history and send it to the group;
    returns what was sent."""
    client = redis_client()
    snapshot = fleet_snapshot(client)
    record_fleet_history(client, snapshot)
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(
            FLEET_GROUP, {"type": "fleet.snapshot", "snapshot": snapshot}
        )
    return snapshot
