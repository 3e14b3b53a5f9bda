"""Periodic loops of the fleet, merged into Celery beat by config/celery.py."""

BEAT_SCHEDULE: dict[str, dict[str, object]] = {
    "serving-reconcile": {"task": "serving.reconcile", "schedule": 2.0},
    "serving-node-health": {"task": "serving.node_health", "schedule": 2.0},
    # Changes publish on commit; this catches anything a lost enqueue missed.
    "serving-publish-routing-table": {"task": "serving.publish_routing_table", "schedule": 5.0},
    # The console overview's live numbers: one snapshot to the `fleet-live` WebSocket group.
    "serving-broadcast-fleet": {"task": "serving.broadcast_fleet", "schedule": 2.0},
    # Queue depth and KV use over a window -> desired replicas (serving/autoscaler.py).
    "serving-autoscale": {"task": "serving.autoscale", "schedule": 10.0},
}
