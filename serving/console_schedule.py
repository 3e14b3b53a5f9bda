"""The console's periodic loop (plain dict, merged into Celery beat like `<app>/schedule.py`)."""

BEAT_SCHEDULE: dict[str, dict[str, object]] = {
    # The overview's live numbers: one snapshot to the `fleet-live` WebSocket group.
    "serving-broadcast-fleet": {"task": "serving.broadcast_fleet", "schedule": 2.0},
}
