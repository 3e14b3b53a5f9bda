"""Periodic loops of the metering app (merged into beat by config/celery.py)."""

BEAT_SCHEDULE: dict[str, dict[str, object]] = {
    "metering-ingest": {"task": "metering.ingest", "schedule": 1.0},
    # Every minute: the margin report and the ledger are current to within a minute.
    "metering-rollups": {"task": "metering.rollup_recent_hours", "schedule": 60.0},
    "metering-invoices": {"task": "metering.refresh_invoices", "schedule": 3600.0},
    "metering-budgets": {"task": "metering.check_budgets", "schedule": 60.0},
    # Also at start-up of the gateway's readers: a book lost from Redis comes back in a minute.
    "metering-publish-prices": {"task": "metering.publish_prices", "schedule": 60.0},
    # Hourly (one catalog query when there is nothing to do, and beat's interval restarts with
    # it): next months' usage partitions made ahead, expired ones dropped.
    "metering-partitions": {"task": "metering.maintain_partitions", "schedule": 3600.0},
}
