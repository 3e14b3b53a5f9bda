"""Periodic loops of the tenants app (merged into Celery beat by config/celery.py)."""

BEAT_SCHEDULE = {
    "tenants-flush-key-last-used": {"task": "tenants.flush_key_last_used", "schedule": 60.0},
    "tenants-republish-key-records": {"task": "tenants.republish_key_records", "schedule": 300.0},
}
