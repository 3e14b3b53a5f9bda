"""The console's Celery task: the live fleet snapshot, sent to every open overview page."""

from __future__ import annotations

from typing import Any

from asgiref.sync import async_to_sync
from celery import shared_task
from channels.layers import get_channel_layer

from serving import telemetry
from serving.console_queries import fleet_snapshot, record_fleet_history

FLEET_GROUP = "fleet-live"


def publish_fleet_snapshot() -> dict[str, Any]:
    """Build one snapshot, add its point to the chart's history and send it to the group;
    returns what was sent."""
    client = telemetry.redis_client()
    snapshot = fleet_snapshot(client)
    record_fleet_history(client, snapshot)
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(
            FLEET_GROUP, {"type": "fleet.snapshot", "snapshot": snapshot}
        )
    return snapshot


@shared_task(name="serving.broadcast_fleet", ignore_result=True)
def broadcast_fleet() -> None:
    """Beat runs this every 2 s; a missed run only delays the next picture by 2 s."""
    publish_fleet_snapshot()
